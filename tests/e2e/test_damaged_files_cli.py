"""A damaged .idx and a damaged checkpoint tracker given to the real entry points: exit status 2, one message naming
the file, no traceback (the unit tests in tests/unit/test_reader_mutations*.py cover every reader; these check that
what they raise reaches the user as it should)."""

from __future__ import annotations

import shutil
import struct

import pytest

from tests.e2e.test_bad_inputs import TINY, run_pretrain, subprocess_cli, workspace  # noqa: F401 - the fixture

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def assert_one_clear_message(status: int, output: str, names: str) -> None:
    assert status == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and names in errors[0], output[-3000:]


def test_launch_with_an_idx_whose_offsets_do_not_follow_the_lengths_exits_2_naming_it(workspace):  # noqa: F811
    prefix = workspace.root / "shifted" / "d_text_document"
    prefix.parent.mkdir(exist_ok=True)
    for suffix in (".bin", ".idx"):
        shutil.copyfile(workspace.data + suffix, str(prefix) + suffix)
    with open(str(prefix) + ".idx", "r+b") as index:  # the second sequence's byte offset, moved by 2 bytes
        header = struct.calcsize("<9sQBQQ")
        sequences = struct.unpack_from("<Q", index.read(header), 18)[0]
        index.seek(header + 4 * sequences + 8)
        offset = struct.unpack("<q", index.read(8))[0]
        index.seek(-8, 1)
        index.write(struct.pack("<q", offset + 2))
    status, output = subprocess_cli([*TINY, *workspace.data_flags(str(prefix)), "--train-iters", "2"])
    assert_one_clear_message(status, output, f"{prefix}.idx: corrupt sequence index")


@pytest.mark.parametrize("tracker", [b"\xb2\x33", "²".encode(), b"3\n3"], ids=["not-utf8", "superscript", "two-lines"])
def test_pretrain_resuming_from_a_damaged_tracker_exits_2_naming_it(workspace, tracker):  # noqa: F811
    root = workspace.copy_checkpoint(f"tracker-{tracker.hex()}")
    (root / "latest_checkpointed_iteration.txt").write_bytes(tracker)
    status, output = run_pretrain([*TINY, *workspace.data_flags(), "--train-iters", "4", "--load", str(root)])
    assert_one_clear_message(status, output, f"{root / 'latest_checkpointed_iteration.txt'}")
