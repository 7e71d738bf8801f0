"""tools/bench.py end to end at a tiny size under torchrun (as ``python -m torch.distributed.run``,
which is what the ``torchrun`` script runs): it runs every configuration and
writes its report. A smoke test only: no timing is asserted (timings are the report's job,
and they are noise on a shared 2-core machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.harness import run_script

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["stage0", "stage1", "stage2", "stage3", "ddp", "ddp+zero", "fsdp2"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench")
    (out / "bench.md").write_text("old table\n<!-- everything below this line is written by hand; "
                                  "tools/bench.py keeps it -->\nhand-written analysis\n")
    result = run_script(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tools" / "bench.py"),
         "--models", "mlp:tiny,gpt:tiny", "--warmup", "1", "--rounds", "1", "--steps-per-round", "2",
         "--comm-reps", "1", "--candidate-option", "bucket_cap_mb=0.01",
         "--candidate-option", "align_for_bandwidth=True", "--out", str(out / "bench.md"), "--png", str(out / "bench.png"),
         "--json", str(out / "bench.json")],
        timeout=240,
        env={"OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return out, json.loads((out / "bench.json").read_text()), log


def test_report_has_every_configuration_and_keeps_the_hand_written_part(report) -> None:
    out, _, _ = report
    text = (out / "bench.md").read_text()
    assert "torchrun --standalone --nproc_per_node 2 tools/bench.py --models mlp:tiny,gpt:tiny" in text
    for model in ("mlp:tiny", "gpt:tiny"):
        assert f"## {model}" in text
    for config in CONFIGS:
        assert f"| {config} |" in text
    for stage in range(4):  # the A/B rows: same stages with the --candidate-option
        assert f"| stage{stage}-cand |" in text and f"× stage{stage}" in text
    assert "old table" not in text
    assert text.rstrip().endswith("hand-written analysis")
    assert "model name" not in text and "`nproc` =" in text


def test_bytes_and_model_state_match_the_closed_forms(report) -> None:
    _, data, _ = report
    for result in data["results"]:
        assert result["world"] == 2
        for config in CONFIGS:
            row = result["configs"][config]
            assert row["step_s"]["median"] > 0
            assert max(row["model_state"]) == pytest.approx(row["formula"], rel=0.10)
            if config.startswith("stage"):
                assert max(row["sent_bytes"]) == pytest.approx(row["closed_form_bytes"], rel=0.01)
                assert 0.0 <= row["hidden"] <= 1.0
        # Every stage, dense (gloo's default) and aligned for NCCL (the -cand rows: parameters at
        # multiples of 64 elements, buckets of lcm(2, 128)): payload and padding are the planner's.
        for stage in range(4):
            for config in (f"stage{stage}", f"stage{stage}-cand"):
                row = result["configs"][config]
                assert row["sent_bytes"] == [pytest.approx(row["closed_form_bytes"])] * 2, config
                assert row["padding_bytes"] == [pytest.approx(row["closed_form_padding_bytes"])] * 2, config
        losses = [row["final_loss"] for row in result["configs"].values()]
        assert max(losses) - min(losses) < 1e-3, "configurations did not train the same model"
