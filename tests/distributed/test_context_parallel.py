"""Context parallelism and DeepSpeed-Ulysses (issue 42) in one 4-rank torchrun launch, at loss parity with one process:
a tiny GPT-2 (learned positions, plain causal attention) under CP 2 with each exchange (p2p ring, allgather, a2a), as
Ulysses 2 (--ds-sequence-parallel-size), CP 4, and CP 2 beside TP 2, PP 2, DeepSpeed ZeRO-2 and FSDP; a tiny Llama
(rope, grouped-query attention) with packed documents masked (--reset-attention-mask, --reset-position-ids,
--eod-mask-loss) under CP 2 and 4, as Ulysses 2, and beside TP 2 and PP 2, and at a 1,024-token sequence under the
ring at CP 2 and 4 (and the GPT at 1,024 tokens under the ring and Ulysses); an MoE GPT under CP 2 × EP 2, without
and with the balancing loss (its expert counts the whole sequences'); gpt-oss's attention (sinks, a sliding window)
and multi-head latent attention under CP 2. A CP 2 run stopped at iteration 2 resumes bitwise; its checkpoint
continues in one process, and the one-process checkpoint at CP 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.launch import read_grad_norms, read_losses, relative_difference, torchrun

RUNS = Path(__file__).with_name("pretrain_runs.py")
ITERATIONS = 4
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
    "--global-batch-size 8 --num-workers 0 --log-interval 1 --eval-iters 0 --lr 1e-3 --lr-warmup-iters 1 "
    f"--train-iters {ITERATIONS} --hidden-dropout 0 --attention-dropout 0 --make-vocab-size-divisible-by 256"
).split()
GPT = BASE
LLAMA = BASE + (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2"
).split()
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
# Dropless: capacity is per rank's tokens, which the sequence split changes. Without the balancing loss the experts'
# computation itself is what CP × EP must keep; with it (MOE_AUX), its expert counts are the whole sequences'
# (summed over the CP ranks, as Megatron-Core sums them over TP × CP), so it matches one process too.
MOE = BASE + "--num-experts 4 --moe-router-topk 2 --disable-moe-token-dropping --moe-aux-loss-coeff 0".split()
MOE_AUX = BASE + "--num-experts 4 --moe-router-topk 2 --disable-moe-token-dropping --moe-aux-loss-coeff 0.1".split()

# gpt-oss's attention (learnable sinks, a 16-token window in the first layer) and DeepSeek's multi-head latent attention
# (a value head smaller than the query/key head), dense.
OSS = BASE + ("--normalization RMSNorm --position-embedding-type rope --softmax-type learnable --window-size 15,0 "
              "--window-attn-skip-freq 2 --group-query-attention --num-query-groups 2").split()
MLA = BASE + ("--normalization RMSNorm --position-embedding-type rope --multi-latent-attention --qk-layernorm "
              "--q-lora-rank 32 --kv-lora-rank 24 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 12 "
              "--rope-type yarn --rotary-scaling-factor 4 --yarn-original-max-position-embeddings 16").split()

CP2 = ["--context-parallel-size", "2"]
LAYOUTS = {
    "gpt": {
        "cp2_p2p": CP2 + ["--cp-comm-type", "p2p"],
        "cp2_allgather": CP2 + ["--cp-comm-type", "allgather"],
        "cp2_a2a": CP2 + ["--cp-comm-type", "a2a"],
        "ulysses2": ["--ds-sequence-parallel-size", "2"],
        "cp4": ["--context-parallel-size", "4"],
        "cp2_tp2": CP2 + ["--tensor-model-parallel-size", "2"],
        "cp2_pp2": CP2 + ["--pipeline-model-parallel-size", "2"],
        "cp2_zero2": CP2 + ["--zero-2-memory-optimization"],
        "cp2_fsdp": CP2 + ["--fsdp-memory-optimization"],
    },
    "llama": {
        "cp2_p2p": CP2,
        "cp4_allgather": ["--context-parallel-size", "4", "--cp-comm-type", "allgather"],
        "cp2_a2a": CP2 + ["--cp-comm-type", "a2a"],
        "ulysses2": ["--ds-sequence-parallel-size", "2"],  # DeepSpeed's name for a2a, with the documents masked
        "cp2_tp2": CP2 + ["--tensor-model-parallel-size", "2"],
        "cp2_pp2": CP2 + ["--pipeline-model-parallel-size", "2", "--cp-comm-type", "allgather"],
        # the ring's backward masks each micro-batch by its own documents, after later micro-batches' forwards
        "cp2_pp2_p2p": CP2 + ["--pipeline-model-parallel-size", "2"],
    },
    "moe": {"cp2_ep2": CP2 + ["--expert-model-parallel-size", "2"]},
    "moeaux": {"cp2_ep2": CP2 + ["--expert-model-parallel-size", "2"]},
    "oss": {"cp2_p2p": CP2, "cp2_a2a": CP2 + ["--cp-comm-type", "a2a"]},
    "mla": {"cp2_p2p": CP2, "cp2_allgather": CP2 + ["--cp-comm-type", "allgather"]},
    # the Llama with packed documents at a long sequence: 1,024 tokens, the ring over 2 and 4 ranks
    "long": {"cp2_p2p": CP2, "cp4_p2p": ["--context-parallel-size", "4"]},
    # the GPT (learned positions, plain causal attention) at the long sequence too: the ring and Ulysses' all-to-all
    "gptlong": {"cp2_p2p": CP2, "ulysses2": ["--ds-sequence-parallel-size", "2"]},
}
LONG = ["--seq-length", "1024", "--micro-batch-size", "1", "--global-batch-size", "4"]
MODELS = {"gpt": GPT, "llama": LLAMA + DOCUMENTS, "moe": MOE, "moeaux": MOE_AUX, "oss": OSS, "mla": MLA, "long": [],
          "gptlong": GPT + LONG}
PARITY = 1e-5  # relative, fp32


def train_here(args: list[str]) -> None:
    from rapidtrain.pretrain import main

    main(args)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory, demo_data) -> list[str]:
    """Data flags of a corpus of short documents (3 to 24 words, the demo tokenizer), so that every 64-token sample
    packs several: the document masks and positions of --reset-attention-mask / --reset-position-ids then matter."""
    import random

    from rapidtrain.data.preprocess import PreprocessSettings, preprocess

    folder = tmp_path_factory.mktemp("short_documents")
    words = ("the of a value returns new list object when given name file data string module None default "
             "type error raise call function class method").split()
    draw = random.Random(42)
    lines = [json.dumps({"text": " ".join(draw.choice(words) for _ in range(draw.randint(3, 24)))})
             for _ in range(600)]
    (folder / "short.jsonl").write_text("\n".join(lines) + "\n")
    result = preprocess(PreprocessSettings(input=str(folder / "short.jsonl"), output_prefix=str(folder / "short"),
                                           tokenizer=demo_data.tokenizer_settings(), append_eod=True, progress=False))
    return ["--data-path", result.data_prefixes["text"], "--tokenizer-type", demo_data.tokenizer_type,
            "--tokenizer-model", demo_data.tokenizer_model, "--split", "100,0,0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, short_documents) -> Path:
    out = tmp_path_factory.mktemp("context_parallel")
    MODELS["llama"] = LLAMA + DOCUMENTS + short_documents
    MODELS["long"] = LLAMA + DOCUMENTS + short_documents + LONG

    def log(name: str) -> list[str]:
        return ["--loss-log-file", str(out / f"{name}.txt")]

    for model, flags in MODELS.items():
        extra = ["--save", str(out / "single_ck"), "--save-interval", "2"] if model == "llama" else []
        train_here(flags + log(f"{model}_single") + extra)
    (out / "single_at2").mkdir()  # the one-process checkpoint of iteration 2 alone
    shutil.copytree(out / "single_ck" / "iter_0000002", out / "single_at2" / "iter_0000002")
    (out / "single_at2" / "latest_checkpointed_iteration.txt").write_text("2\n")
    llama = MODELS["llama"]
    runs = [MODELS[model] + layout + log(f"{model}_{name}")
            for model, layouts in LAYOUTS.items() for name, layout in layouts.items()]
    runs += [llama + CP2 + log("llama_cp2_resumed") + ["--exit-interval", "2", "--save", str(out / "cp2_at2")],
             llama + CP2 + log("llama_cp2_resumed") + ["--load", str(out / "cp2_at2")],
             llama + CP2 + ["--cp-comm-type", "a2a"] + log("llama_cp2_from_single") + ["--load",
                                                                                        str(out / "single_at2")]]
    (out / "runs.json").write_text(json.dumps(runs))
    torchrun(4, RUNS, [str(out / "runs.json")], timeout=1800, warm=True)
    return out


def differences(out: Path, name: str, reference: str) -> dict[str, float]:
    losses = read_losses(out / f"{name}.txt")
    reference_losses = read_losses(out / f"{reference}.txt")
    iterations = sorted(losses)
    norms, reference_norms = read_grad_norms(out / f"{name}.txt"), read_grad_norms(out / f"{reference}.txt")
    return {"lm loss": relative_difference(losses, {i: reference_losses[i] for i in iterations}),
            "grad norm": relative_difference(norms, {i: reference_norms[i] for i in iterations})}


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"{model}_{layout}" for model, layouts in LAYOUTS.items() for layout in layouts])
def test_context_parallel_layout_matches_one_process(trained, name):
    found = differences(trained, name, f"{name.split('_')[0]}_single")
    print(f"{name}: {found}")
    assert sorted(read_losses(trained / f"{name}.txt")) == list(range(1, ITERATIONS + 1))
    assert all(value < PARITY for value in found.values()), found


@pytest.mark.slow
def test_documents_change_the_loss(trained, short_documents, tmp_path):
    """The document parity above would hold trivially if the samples held one document each: the same Llama on the
    same data without the document flags has another loss."""
    train_here(LLAMA + short_documents + ["--loss-log-file", str(tmp_path / "whole.txt")])
    assert read_losses(tmp_path / "whole.txt")[1] != read_losses(trained / "llama_single.txt")[1]


@pytest.mark.slow
def test_cp2_resumes_bitwise_and_checkpoints_cross_cp_sizes(trained, tmp_path):
    resumed, uninterrupted = read_losses(trained / "llama_cp2_resumed.txt"), read_losses(trained / "llama_cp2_p2p.txt")
    assert sorted(resumed) == list(range(1, ITERATIONS + 1))
    assert [resumed[i] for i in (3, 4)] == [uninterrupted[i] for i in (3, 4)]
    # CP 2's checkpoint of iteration 2 continues in one process (CP 1) as the one-process run did.
    train_here(MODELS["llama"] + ["--load", str(trained / "cp2_at2"), "--loss-log-file", str(tmp_path / "cp1.txt")])
    single = read_losses(trained / "llama_single.txt")
    continued = read_losses(tmp_path / "cp1.txt")
    assert sorted(continued) == [3, 4]
    assert relative_difference(continued, {i: single[i] for i in (3, 4)}) < PARITY
    # ... and the one-process checkpoint continues at CP 2 (a2a).
    from_single = read_losses(trained / "llama_cp2_from_single.txt")
    assert sorted(from_single) == [3, 4]
    assert relative_difference(from_single, {i: single[i] for i in (3, 4)}) < PARITY
