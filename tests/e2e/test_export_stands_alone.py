"""A `scripts/convert_checkpoint.py --hf` export stands alone: transformers loads the model and its tokenizer from
the folder with nothing of rapidtrain, and continues a prompt greedily as `rapidtrain generate` does from the
checkpoint, for each model family the export writes (GPT-2, Llama, Mixtral) and for the tokenizers a run uses (the
demo corpus's SentencePiece with Megatron's appended pieces, GPT-2 BPE). The export and rapidtrain's continuations
run in the test's process (their commands' own functions); transformers' in one that never imports rapidtrain."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import subprocess
import sys

import pytest

from rapidtrain.data.demo import TOKENIZER_VOCAB_SIZE
from rapidtrain.data.tokenizer import build_tokenizer
from tests.launch import ARCHITECTURES, REPO, TINY_GPT_SHAPE, child_env

PROMPTS = ("Return a new", "The history of")
FAMILIES = {
    "gpt2": ARCHITECTURES["gpt2"],
    "llama": ARCHITECTURES["llama"],
    "mixtral": [*ARCHITECTURES["llama"], "--num-experts", "4", "--moe-router-topk", "2"],
}


def train(folder, flags: list[str]) -> None:
    from rapidtrain.pretrain import main

    # A high learning rate for a few iterations: a model whose greedy choices are not all the same token.
    main([*TINY_GPT_SHAPE, "--micro-batch-size", "4", "--num-workers", "0", "--eval-iters", "0", "--lr", "1e-2",
          "--lr-warmup-iters", "1", "--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--save", str(folder), *flags])


def export(checkpoint, output) -> str:
    """`python scripts/convert_checkpoint.py --load CK --output OUT --hf`, run in this process (its main, as the
    script's own block calls it): what is checked is the folder it writes and what it prints, and the process that
    reads the folder back below has nothing of rapidtrain. Its printed lines."""
    convert = runpy.run_path(str(REPO / "scripts" / "convert_checkpoint.py"), run_name="convert_checkpoint")["main"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = convert(["--load", str(checkpoint), "--output", str(output), "--hf"])
    assert status == 0, printed.getvalue()[-3000:]
    return printed.getvalue()


def rapidtrain_greedy(checkpoint, prompt: str, tokens: int) -> str:
    """What `rapidtrain generate --load CK --prompt P --max-new-tokens N` prints, by its command's function in this
    process (rapidtrain/cli.py's generate runs it; the README test starts the command itself)."""
    from rapidtrain.cli import generate_command

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = generate_command(["--load", str(checkpoint), "--prompt", prompt, "--max-new-tokens", str(tokens)])
    assert status == 0, printed.getvalue()[-3000:]
    return printed.getvalue().rstrip("\n")


TRANSFORMERS_ALONE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
out = []
for prompt in prompts:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    # The folder's own generation settings: it stops at the end of document its config.json names.
    new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                         do_sample=False)[0, ids.shape[1]:]
    new = new.tolist()
    if model.generation_config.eos_token_id in new:
        new = new[:new.index(model.generation_config.eos_token_id)]
    text = tokenizer.decode(ids[0].tolist() + new)
    out.append(prompt + text[len(tokenizer.decode(ids[0].tolist())):])
ids = {name: [getattr(model.config, name), getattr(model.generation_config, name), getattr(tokenizer, name)]
       for name in ("eos_token_id", "bos_token_id", "pad_token_id")}
print(json.dumps({"continuations": out, "ids": ids}))
"""


def transformers_greedy(folder, prompts: tuple[str, ...], tokens: int) -> dict:
    """Continuations by transformers in a process that never imports rapidtrain (no PYTHONPATH to the checkout),
    and the special ids as the model's config, its generation config and the tokenizer name them."""
    env = child_env()
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "-c", TRANSFORMERS_ALONE, str(folder), str(tokens), json.dumps(prompts)],
                            cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rapidtrain" not in result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_export_with_the_demo_tokenizer_continues_as_rapidtrain_generate(tmp_path, demo_data, family):
    train(tmp_path / "ck", FAMILIES[family])
    printed = export(tmp_path / "ck", tmp_path / "out")
    assert f"with its tokenizer (SentencePieceTokenizer, {TOKENIZER_VOCAB_SIZE} ids)" in printed
    folder = tmp_path / "out" / "hf"
    assert (folder / "tokenizer.json").exists()
    expected = [rapidtrain_greedy(tmp_path / "ck", prompt, 12) for prompt in PROMPTS]
    assert all(len(text) > len(prompt) for text, prompt in zip(expected, PROMPTS, strict=True))
    theirs = transformers_greedy(folder, PROMPTS, 12)
    assert theirs["continuations"] == expected
    # config.json names the run's end of document as eos (Megatron's <EOD>, appended after the model's pieces), the
    # SentencePiece model's <s> as bos and Megatron's appended <PAD> as pad, and generate reads them from there.
    ours = build_tokenizer(demo_data.tokenizer_settings())
    assert ours.eod == TOKENIZER_VOCAB_SIZE - 3 and ours.pad == TOKENIZER_VOCAB_SIZE - 1
    assert theirs["ids"] == {"eos_token_id": [ours.eod] * 3, "bos_token_id": [1] * 3, "pad_token_id": [ours.pad] * 3}
    assert f"config.json names eos_token_id {ours.eod}, bos_token_id 1, pad_token_id {ours.pad}" in printed


@pytest.mark.slow
def test_hf_export_with_a_gpt2_bpe_tokenizer_encodes_as_the_run_did(tmp_path, demo_data):
    """GPT-2 BPE files (vocab.json + merges.txt): the exported tokenizer gives the run's ids and end of document."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer

    from rapidtrain.data.hf_tokenizer import hf_tokenizer, special_token_ids
    from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer

    texts = [f"The history of {topic} begins with statement number {i}." for i, topic in
             enumerate(["Python", "loops", "classes", "modules"] * 10)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(tmp_path))
    settings = TokenizerSettings("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                 merge_file=str(tmp_path / "merges.txt"))
    hf_tokenizer(settings).save_pretrained(tmp_path / "hf")
    ours, theirs = build_tokenizer(settings), AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in [*texts[:5], "  spaces, émigré and 数字 too\n"]:
        assert theirs.encode(text, add_special_tokens=False) == ours.tokenize(text)
        assert theirs.decode(ours.tokenize(text)) == ours.detokenize(ours.tokenize(text))
    assert theirs.eos_token_id == ours.eod
    # An export's config.json names <|endoftext|> as GPT-2 does (eos and bos) and no pad, which GPT-2 has not.
    assert special_token_ids(settings, theirs) == {"eos_token_id": ours.eod, "bos_token_id": ours.eod}
