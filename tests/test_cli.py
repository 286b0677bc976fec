"""Shared flags: defaults, parsing, and one-line usage errors."""
import pytest
import torch

from common.cli import Config, parse_config
from support.run import run_script


def test_defaults_are_the_quickstarts():
    cfg = parse_config([])
    assert (cfg.epochs, cfg.batch_size, cfg.lr) == (5, 64, 1e-3)
    assert cfg.output.startswith("runs")


def test_flags_parse():
    cfg = parse_config("--epochs 2 --batch-size 96 --lr 0.01 --seed 3 --device cpu --output out "
                       "--train-samples 100 --test-samples 50 --log-every 7 --data-dir d".split())
    assert cfg == Config(epochs=2, batch_size=96, lr=0.01, seed=3, data_dir="d", device="cpu", output="out",
                         train_samples=100, test_samples=50, log_every=7)
    assert cfg.describe().startswith("Config: epochs=2 batch_size=96 lr=0.01")


BAD = [
    ["--epochs", "0"], ["--epochs", "-1"], ["--epochs", "two"], ["--batch-size", "0"], ["--lr", "-0.1"],
    ["--lr", "0"], ["--lr", "nan"], ["--train-samples", "0"], ["--device", "tpu"], ["--device", "banana"], ["--bogus"],
]
if not torch.cuda.is_available():
    BAD.append(["--device", "cuda"])


@pytest.mark.parametrize("argv", BAD, ids=" ".join)
def test_bad_flag_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


NO_CPU_STREAM_EVENTS = "import torch\ndel torch.cpu.Stream.record_event\n"  # as on torch 2.6


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_fsdp_on_a_torch_without_cpu_stream_events_is_one_line(world_size, tmp_path):
    """FSDP2 on the CPU times its gathers with torch.cpu.Stream.record_event (torch 2.6 has none): fsdp.py refuses at
    any world size, one rank included (it shards over that one rank too); tensor_parallel.py only where it uses FSDP2
    (--dp above 1), so with --dp 1 it goes on to torchrun's check."""
    (tmp_path / "sitecustomize.py").write_text(NO_CPU_STREAM_EVENTS)
    env = dict(PYTHONPATH=str(tmp_path), WORLD_SIZE=world_size)
    fsdp, tp = (run_script(script, "--device", "cpu", env=env, timeout=120) for script in ("fsdp.py",
                                                                                           "tensor_parallel.py"))
    assert fsdp.returncode == 2 and "fsdp.py on the CPU needs torch 2.7 or later" in fsdp.stderr
    assert tp.returncode == 2 and "start this script with torchrun" in tp.stderr, tp.stderr
