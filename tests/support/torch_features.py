"""What this torch has that some chapters need on the CPU (tests/test_torch_range.py checks each refusal without it)."""
import torch

from pipeline import pipelining_missing

FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")  # torch 2.7: FSDP2 times its gathers with CPU stream events
GLOO_FLIGHT_RECORDER = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")  # torch 2.8: gloo's collectives recorded
PIPELINE_SCHEDULES = not pipelining_missing()  # torch 2.9: schedules with scale_grads= and eval()
