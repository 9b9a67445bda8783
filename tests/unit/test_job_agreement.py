"""One configuration per job, the pure half: any flag or data file that differs between two ranks changes their
fields (config/job_identity.py), and the message names that field, both values and the ranks holding each."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from rapidtrain.config import rules
from rapidtrain.config.arguments import parse_args
from rapidtrain.config.job_identity import data_files, job_fields
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.train.agreement import digest_of, mismatch_message

BASE = ["--train-iters", "10", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "16", "--micro-batch-size", "2"]
# flag, the other rank's value, the resolved field it must show in
CHANGES = [
    ("--micro-batch-size", "4", "data.micro_batch_size"),
    ("--seq-length", "32", "data.seq_length"),
    ("--global-batch-size", "32", "batches.global_batch_size"),
    ("--lr", "2e-3", "schedule.lr"),
    ("--hidden-size", "128", "model.hidden_size"),
    ("--seed", "5", "training.seed"),
    ("--split", "90,10,0", "data.split"),
    ("--clip-grad", "0.5", "clip_grad"),
    ("--tokenizer-type", "NullTokenizer", "tokenizer.tokenizer_type"),
]


def plan_for(flags: list[str], world: int = 4):
    ctx = RunContext(world_size=world)
    args = parse_args(BASE + flags)
    rules.validate(args, ctx)
    return from_args(args, ctx)


@settings(max_examples=12, deadline=None)
@given(change=st.sampled_from(CHANGES), world=st.sampled_from([2, 4]), data=st.data())
def test_a_rank_with_one_flag_changed_is_named_with_its_field_and_values(change, world, data):
    flag, value, field = change
    odd_rank = data.draw(st.integers(0, world - 1))
    extra = ["--vocab-size", "512"] if "NullTokenizer" in value else []
    same, other = job_fields(plan_for(extra)), job_fields(plan_for([flag, value, *extra]))
    assert digest_of(same) != digest_of(other)
    by_rank = [other if rank == odd_rank else same for rank in range(world)]
    hosts = [f"node{rank // 2}" for rank in range(world)]
    message = mismatch_message(by_rank, hosts)
    line = next(text for text in message.splitlines() if text.strip().startswith(field + ":"))
    assert same[field] in line and other[field] in line
    assert f"on rank {odd_rank} (host node{odd_rank // 2})" in line
    others = [rank for rank in range(world) if rank != odd_rank]
    assert f"on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} " in line


def test_equal_flags_give_equal_digests():
    assert digest_of(job_fields(plan_for([]))) == digest_of(job_fields(plan_for([])))


def test_nodes_with_different_core_counts_agree(monkeypatch):
    """Each node gives its ranks its own cores' worth of CPU threads (config/resolve.py): a job over an 8-core
    and a 16-core node is one configuration, while the threads each chose still differ in their plans."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    small = plan_for([])
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    large = plan_for([])
    assert small.switches.cpu_threads != large.switches.cpu_threads
    assert digest_of(job_fields(small)) == digest_of(job_fields(large))


def test_a_data_file_of_another_size_on_one_node_is_a_difference(tmp_path):
    """The same --data-path on two nodes, one holding a shorter copy: the sizes differ, the flags do not."""
    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        (prefix.parent / (prefix.name + suffix)).write_bytes(b"x" * 100)
    flags = ["--data-path", str(prefix)]
    first = job_fields(plan_for(flags))
    (prefix.parent / "corpus.bin").write_bytes(b"x" * 60)
    os.utime(prefix.parent / "corpus.bin", (0, 0))
    second = job_fields(plan_for(flags))
    message = mismatch_message([first, second], ["a", "b"])
    assert f"file {prefix}.bin: 100 bytes on rank 0 (host a); 60 bytes on rank 1 (host b)" in message
    assert f"{prefix}.idx" in data_files(plan_for(flags))
