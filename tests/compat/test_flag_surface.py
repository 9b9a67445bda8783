"""The Megatron family's whole flag surface (rapidtrain/config/megatron_flags.json): every flag classified, accepted
with its origins' values, refused or noted as its status says; the generated table in docs/megatron-compat.md
is up to date."""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import pytest

from rapidtrain.config.arguments import build_parser, parse_args
from rapidtrain.config.flag_surface import FlagRefused, classify, own_flags_help, surface_flags


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(scope="module")
def treatments(parser):
    own = own_flags_help(parser)
    return {record["flag"]: classify(record["flag"], own) for record in surface_flags()}


def test_every_flag_of_the_data_file_is_classified(treatments):
    counts: dict[str, Counter] = defaultdict(Counter)
    for record in surface_flags():
        treatment = treatments[record["flag"]]
        for origin in record["origins"]:
            counts[origin][treatment.status if treatment else "UNCLASSIFIED"] += 1
    for origin, by_status in sorted(counts.items()):
        print(f"{origin}: " + ", ".join(f"{status} {n}" for status, n in sorted(by_status.items())))
    unclassified = [flag for flag, treatment in treatments.items() if treatment is None]
    assert not unclassified, f"{len(unclassified)} flags without a status: {' '.join(unclassified)}"
    assert len(treatments) > 1300


def _values(record: dict, own: argparse.Action | None) -> list[list[str]]:
    """Argument lists the origins accept for the flag: every choice in every spelling, or one typed sample
    (rapidtrain's own values where the origin documents none)."""
    if record["action"] in ("store_true", "store_false", "optional_bool") or (own and own.nargs == 0):
        return [[]]
    if record["choices"]:
        return [[str(choice)] for choice in record["choices"]]
    if own is not None and own.choices and not record["choices"]:
        return [[str(choice)] for choice in own.choices if isinstance(choice, str)]
    sample = "2" if record["type"] in ("int", "float") or (own and own.type not in (None, str)) else "x"
    count = own.nargs if own is not None and isinstance(own.nargs, int) else {"+": 2, "*": 2, 3: 3}.get(
        record["nargs"], 1)
    return [[sample] * count]


def test_every_flag_is_accepted_with_each_origins_values(parser):
    rejected = []
    for record in surface_flags():
        for name in (record["flag"], *record["aliases"]):
            own = parser._option_string_actions.get(name)
            for values in _values(record, own):
                try:
                    namespace, extras = parser.parse_known_args([name, *values])
                except SystemExit:
                    extras = ["exit"]
                if extras:
                    rejected.append(f"{name} {' '.join(values)}")
    assert not rejected, f"{len(rejected)} rejected: {rejected[:20]}"


def _switches(treatments, status: str) -> list[str]:
    chosen = [(record["flag"], treatments[record["flag"]]) for record in surface_flags()
              if record["action"] == "store_true"]
    return [flag for flag, treatment in chosen
            if treatment.kind in ("listed", "pattern") and treatment.status == status]


def test_every_refused_switch_stops_the_run_naming_it(treatments):
    flags = _switches(treatments, "refused")
    with pytest.raises(FlagRefused) as refused:
        parse_args(flags)
    message = str(refused.value)
    assert len(flags) > 60 and [flag for flag in flags if f"  {flag}:" not in message] == []


def test_every_no_effect_switch_is_a_line_in_the_plan(treatments):
    flags = _switches(treatments, "no_effect")
    notes = "\n".join(parse_args(flags).compat_notes)
    assert len(flags) > 100 and [flag for flag in flags if f"{flag}: no effect here" not in notes] == []


def test_a_refused_flag_given_its_default_asks_for_nothing():
    args = parse_args(["--context-parallel-size", "1", "--rope-type", "rope", "--expert-tensor-parallel-size", "1"])
    assert args.tensor_model_parallel_size == 1


def test_refusal_names_the_flag_the_reason_and_what_to_use(capsys):
    with pytest.raises(FlagRefused, match=r"--expert-tensor-parallel-size 2: experts are not split .* shard them"):
        parse_args(["--expert-tensor-parallel-size", "2"])


def test_context_parallel_flags_work_and_hierarchical_cp_is_refused():
    args = parse_args(["--context-parallel-size", "2", "--cp-comm-type", "allgather", "--ds-sequence-parallel-size",
                       "1"])
    assert (args.context_parallel_size, args.cp_comm_type) == (2, ["allgather"])
    with pytest.raises(FlagRefused, match=r"--hierarchical-context-parallel-sizes .*hierarchical"):
        parse_args(["--hierarchical-context-parallel-sizes", "2", "2"])


def test_the_2020_names_and_fork_spellings_land_on_rapidtrains_flags():
    args = parse_args(["--model-parallel-size", "2", "--pipe-parallel-size", "2", "--batch-size", "4",
                       "--warmup", "0.01", "--normalization", "rmsnorm", "--split", "'99,1,0'",
                       "--use-rotary-position-embeddings", "--reduce-bucket-size", "4e8"])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size) == (2, 2, 4)
    assert (args.lr_warmup_fraction, args.normalization, args.split) == (0.01, "RMSNorm", "99,1,0")
    assert args.position_embedding_type == "rope" and args.zero_reduce_bucket_size == 500_000_000  # not DeepSpeed's
    assert any(note.startswith("--reduce-bucket-size 400000000.0: no effect here") for note in args.compat_notes)
    assert any(note.startswith("--batch-size 4: Megatron 2020's name") for note in args.compat_notes)


def test_pad_vocab_size_to_gives_exactly_that_many_rows_or_is_refused_naming_it(capsys):
    """BigScience's --pad-vocab-size-to: N rows for the demo tokenizer's 2,005 ids (plan), refused when the
    tensor-parallel size does not divide N (parsing) or N is below the tokenizer's ids (the rules)."""
    from rapidtrain.cli import plan_command

    assert plan_command(["--train-iters", "2", "--pad-vocab-size-to", "8192", "--tensor-model-parallel-size", "2",
                         "--world-size", "2"]) == 0
    output = capsys.readouterr().out
    assert "padded vocab 8192" in output and "--pad-vocab-size-to 8192: the embedding has exactly 8192 rows" in output
    with pytest.raises(FlagRefused, match=r"--pad-vocab-size-to 8191: .* a positive multiple of 2"):
        parse_args(["--pad-vocab-size-to", "8191", "--tensor-model-parallel-size", "2"])
    with pytest.raises(SystemExit) as stop:
        plan_command(["--train-iters", "2", "--pad-vocab-size-to", "2000"])
    assert stop.value.code == 2
    assert "--pad-vocab-size-to 2000 is smaller than the tokenizer's vocabulary of 2005 ids" in capsys.readouterr().err


def test_a_list_flag_written_as_separate_words_is_one_schedule():
    args = parse_args(["--step-batch-size-schedule", "0:16", "2.4B:320", "--global-batch-size", "320"])
    assert args.step_batch_size_schedule == "0:16 2.4B:320"


def test_token_based_schedules_become_samples_or_iterations():
    sampled = parse_args(["--seq-length", "2048", "--train-tokens", "300000000", "--lr-decay-tokens", "260000000",
                          "--lr-warmup-tokens", "375000000"])
    assert (sampled.train_samples, sampled.lr_decay_samples, sampled.lr_warmup_samples) == (146485, 126954, 183106)
    counted = parse_args(["--seq-length", "1000", "--global-batch-size", "10", "--train-iters", "1000000",
                          "--train-tokens", "200000", "--lr-warmup-tokens", "30000"])
    assert (counted.train_iters, counted.lr_warmup_iters) == (20, 3)


def test_zero_stage_selects_rapidtrains_zero_switch_and_gas_the_global_batch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args(["--deepspeed", "--zero-stage", "2", "--micro-batch-size", "2", "--gas", "3"])
    assert args.zero_2_memory_optimization and args.zero_stage == 2 and args.global_batch_size == 24


def test_megatron_core_moe_flags(monkeypatch):
    args = parse_args(["--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "6",
                       "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-router-load-balancing-type", "aux_loss",
                       "--moe-grouped-gemm"])
    assert args.num_experts == [0, 8, 8, 8] and args.moe_router_topk == 6
    with pytest.raises(FlagRefused, match="--moe-router-topk 9"):
        parse_args(["--num-experts", "8", "--moe-router-topk", "9"])


def test_tokenizer_names_of_other_origins():
    args = parse_args(["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", "folder"])
    assert (args.tokenizer_type, args.tokenizer_model) == ("HuggingFaceTokenizer", "folder")
    with pytest.raises(FlagRefused, match="--tokenizer-type TikTokenizer: not in rapidtrain"):
        parse_args(["--tokenizer-type", "TikTokenizer"])


def test_a_flag_of_no_parser_still_gets_did_you_mean(capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--zero-stagee", "2"])
    assert stopped.value.code == 2 and "did you mean --zero-stage?" in capsys.readouterr().err


def test_the_flag_table_in_the_docs_is_up_to_date():
    from scripts.make_megatron_compat import DOC, rendered

    assert DOC.read_text() == rendered(), "run python scripts/make_megatron_compat.py"
