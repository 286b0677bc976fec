"""The PyTorch quickstart network, unchanged, so every chapter trains the same thing."""
from torch import nn


class NeuralNetwork(nn.Module):
    """Flatten, then 784-512-512-10 with ReLU: the quickstart MLP for 28x28 FashionMNIST images."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )

    def forward(self, x):
        """Return the 10 class logits for a batch of images."""
        x = self.flatten(x)
        return self.linear_relu_stack(x)

