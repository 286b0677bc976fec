"""measure/strategy_table.py: its numbers come from the runs, agree with what the strategies must hold and send, and
docs/strategies.md's table is the script's output."""
import re
import subprocess
import sys

import pytest

from pipeline import pipelining_missing
from support import REPO
from support.run import BASE_ENV

pytestmark = pytest.mark.skipif(bool(pipelining_missing()), reason=str(pipelining_missing()))  # it runs pipeline.py

MODEL_BYTES = 669_706 * 4  # the quickstart MLP's fp32 weights
BATCH = 64  # the script's global batch


def kib(n):
    return f"{n / 1024:,.0f}"


@pytest.fixture(scope="module")
def table(real_data):
    """The script's table for DDP, tensor parallel and the pipeline at 2 and 4 ranks: {(strategy, ranks): its cells}."""
    proc = subprocess.run([sys.executable, "measure/strategy_table.py", "--rows", "ddp,tp,pp", "--ranks", "2,4",
                           "--data-dir", str(real_data)], cwd=REPO, env=BASE_ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| strategy")]
    return {(cells[0], cells[1]): cells for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)}


def test_the_numbers_are_what_each_strategy_must_hold_and_send(table):
    """Computed by hand: DDP holds the whole model 3 times (weights, gradients, momentum) and all-reduces every
    gradient (two buckets), a ring sending 2(n-1)/n of it; tp n holds 1/n of the two big layers and all-reduces a
    64 x 512 activation once per forward; 2 stages hold the first Linear on rank 0, and each stage sends 4 micro-
    batches of 16 x 512 activations (forward) or their gradients (backward)."""
    for n in (2, 4):
        ddp = table["DDP (chapters 3-6)", str(n)]
        assert ddp[2:7] == [*[kib(MODEL_BYTES)] * 3, "2 all_reduce", kib(2 * (n - 1) / n * MODEL_BYTES)], ddp
        tp_held = ((512 * 784 + 512) // n + 512 * 512 // n + 512 + 10 * 512 + 10) * 4
        tp = table["tensor parallel (chapter 9)", str(n)]
        assert tp[2:7] == [*[kib(tp_held)] * 3, "1 all_reduce", kib(2 * (n - 1) / n * BATCH * 512 * 4)], tp
    pp = table["pipeline, GPipe, 4 micro-batches (chapter 10)", "2"]
    stage0 = (784 * 512 + 512) * 4
    assert pp[1:7] == ["2", *[kib(stage0)] * 3, "4 send (point-to-point)", kib(4 * BATCH // 4 * 512 * 4)], pp


def test_the_docs_table_is_the_scripts_output(table):
    """docs/strategies.md's rows for the same strategies are the ones the script prints (written by --write, not by
    hand)."""
    page = (REPO / "docs" / "strategies.md").read_text()
    block = page.split("<!-- strategy table: made by measure/strategy_table.py --write docs/strategies.md -->")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines() if re.match(r"\| \w", line)]
    for (name, ranks), cells in table.items():
        twin = [row for row in rows if row[0] == name and row[1] == ranks]
        assert twin == [cells], (name, twin, cells)
