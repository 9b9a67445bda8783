"""`rapidtrain generate` as an inference tool: batched left-padded decoding equals one prompt at a time (built-in GPT
and Hugging Face models), an exported model decodes exactly what transformers' own generate does, Hugging Face
folders load with their tokenizer, prompts come from and go to JSON lines, and every runtime flag either changes
what runs (named in the first line) or is refused with the reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rapidtrain import cli
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.hf_weights import save_hf_folder
from rapidtrain.models.transformer import KVCache
from rapidtrain.train.generation import Decoding, SamplingSettings, decode, left_padded
from rapidtrain.train.generation.decoding import builtin_forward
from rapidtrain.train.generation.loading import hf_forward, load_hf_model
from rapidtrain.train.generation.runtime import Runtime
from rapidtrain.train.generation.static import compiled_step, decode_static
from tests.launch import TINY_GPT_SHAPE

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
             max_position_embeddings=48, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(normalization="RMSNorm", swiglu=True, num_query_groups=2, add_bias_linear=False,
             position_embedding_type="rope", tie_embeddings=False, ffn_hidden_size=48)
SHAPES = {"gpt2": {}, "llama": LLAMA, "qwen2": LLAMA | dict(add_qkv_bias=True),
          "mixtral": LLAMA | dict(num_experts=(4, 4), moe_router_topk=2, moe_token_dropping=False)}
GREEDY = Decoding(SamplingSettings(max_new_tokens=12))


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (3, 7, 1, 5)]


def one_at_a_time(forward, new_cache) -> list[list[int]]:
    return [decode(forward, *left_padded([p], 0, "cpu"), GREEDY, new_cache)[0].tolist() for p in prompts()]


def batched(forward, new_cache, how: Decoding = GREEDY) -> list[list[int]]:
    return decode(forward, *left_padded(prompts(), 0, "cpu"), how, new_cache).tolist()


@pytest.mark.parametrize("kernel", ["sdpa", "eager", "flex"])
@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_batched_left_padded_greedy_equals_one_prompt_at_a_time(shape, kernel):
    model = build_model(ModelConfig(**SMALL | SHAPES[shape] | {"attention_kernel": kernel}), seed=3).eval()
    forward = builtin_forward(model)
    alone = one_at_a_time(forward, KVCache)
    assert len({tuple(row) for row in alone}) == 4  # the prompts lead to different continuations
    assert batched(forward, KVCache) == alone
    assert batched(forward, KVCache, Decoding(GREEDY.settings, use_cache=False)) == alone


@pytest.mark.parametrize("shape", ["gpt2", "llama", "mixtral"])
def test_static_cache_decodes_what_the_growing_cache_does(shape):
    """The static cache's steps attend over every preallocated slot under the mask of the written ones."""
    model = build_model(ModelConfig(**SMALL | SHAPES[shape]), seed=3).eval()
    forward = builtin_forward(model)
    how = Decoding(SamplingSettings(max_new_tokens=12, min_new_tokens=3), eos_id=5)
    tokens, mask = left_padded(prompts(), 0, "cpu")
    assert decode_static(forward, forward, tokens, mask, how).tolist() == batched(forward, KVCache, how)


@pytest.mark.parametrize("shape", [dict(position_embedding_type="alibi"), dict(sliding_window=4)])
def test_static_cache_refuses_distance_dependent_attention(shape):
    """ALiBi and sliding windows count back from the last cached key; a static step's last slot is not it."""
    model = build_model(ModelConfig(**SMALL | shape), seed=3).eval()
    forward = builtin_forward(model)
    with pytest.raises(ValueError, match="ALiBi and sliding-window models decode through the growing cache"):
        decode_static(forward, forward, *left_padded(prompts(), 0, "cpu"), GREEDY)


@pytest.mark.slow  # compiling the step: 20-60 s on 2 shared cores
def test_compiled_step_decodes_what_the_uncompiled_loop_does():
    """--torch-compile's path: the one-token step compiled once (static shapes), left-padded batch, rope."""
    model = build_model(ModelConfig(**SMALL | LLAMA), seed=3).eval()
    forward = builtin_forward(model)
    tokens, mask = left_padded(prompts(), 0, "cpu")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = compiled_step(model, "cpu")
    assert decode_static(forward, step, tokens, mask, GREEDY).tolist() == batched(forward, KVCache)
    # Another prompt length in the same cache bucket reuses the compiled step.
    shorter = decode_static(forward, step, tokens[:, 1:], mask[:, 1:], GREEDY)
    assert shorter.tolist() == decode(forward, tokens[:, 1:], mask[:, 1:], GREEDY, KVCache).tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.fixture(scope="module", params=list(SHAPES))
def exported(request, tmp_path_factory):
    """A random built-in model of each exportable family and its Hugging Face export, loaded by transformers."""
    model = build_model(ModelConfig(**SMALL | SHAPES[request.param]), seed=3).eval()
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    assert save_hf_folder(model.state_dict(), model.config, folder) == request.param
    return model, load_hf_model(folder, Runtime())


def test_exported_model_decodes_what_transformers_generate_does(exported):
    model, hf = exported
    theirs = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
              for p in prompts()]
    assert one_at_a_time(builtin_forward(model), KVCache) == theirs


def test_hugging_face_model_batched_equals_one_at_a_time(exported):
    from transformers import DynamicCache

    _, hf = exported
    forward, new_cache = hf_forward(hf), lambda: DynamicCache(config=hf.config)
    assert batched(forward, new_cache) == one_at_a_time(forward, new_cache)


# ---- the command ----


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_data):
    """A briefly trained built-in GPT checkpoint, its Hugging Face export, and the demo tokenizer's flags."""
    from rapidtrain.pretrain import main
    from scripts.convert_checkpoint import main as convert

    root = tmp_path_factory.mktemp("inference")
    main([*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--num-workers", "0", "--eval-iters", "0", "--lr", "1e-3",
          "--lr-warmup-iters", "1", "--train-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--save", str(root / "ck")])
    assert convert(["--load", str(root / "ck"), "--output", str(root / "export"), "--hf"]) == 0
    tokenizer = ["--tokenizer-type", demo_data.tokenizer_type, "--tokenizer-model", demo_data.tokenizer_model]
    return root / "ck", root / "export" / "hf", tokenizer


PROMPTS = ["Once upon a time", "The history of the city", "A", "In 1990 the band released their"]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_checkpoint_and_its_hf_export_write_the_same_jsonl_batched_or_not(trained, tmp_path, capsys):
    checkpoint, hf_folder, tokenizer = trained
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    outputs = {}
    for name, load, batch in (("one", [str(checkpoint)], "1"), ("four", [str(checkpoint)], "4"),
                              ("hf", [str(hf_folder), *tokenizer], "3")):
        out_file = tmp_path / f"{name}.jsonl"
        code, _, err = run(["--load", *load, "--input-file", str(prompts_file), "--output-file", str(out_file),
                            "--batch-size", batch, "--max-new-tokens", "10"], capsys)
        assert code == 0, err
        assert err.splitlines()[0].startswith("rapidtrain generate: ") and f"batch size {batch}" in err
        outputs[name] = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [row["prompt"] for row in outputs["one"]] == PROMPTS
    assert all(row["completion"] for row in outputs["one"])
    assert outputs["four"] == outputs["one"] == outputs["hf"]
    assert "transformers GPT2LMHeadModel" in err


def test_prompt_flag_prints_and_writes_the_output_file(trained, tmp_path, capsys):
    checkpoint, _, _ = trained
    out_file = tmp_path / "one.jsonl"
    code, out, _ = run(["--load", str(checkpoint), "--prompt", "Once upon a time", "--max-new-tokens", "6",
                        "--output-file", str(out_file)], capsys)
    assert code == 0
    row = json.loads(out_file.read_text())
    assert out.strip() == row["prompt"] + row["completion"] and row["prompt"] == "Once upon a time"


def test_bad_prompts_and_folders_are_named_in_one_line(trained, tmp_path, capsys):
    checkpoint, hf_folder, _ = trained
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    code, _, err = run(["--load", str(checkpoint), "--input-file", str(bad)], capsys)
    assert code == 2 and f"{bad}:2: expected" in err and "Traceback" not in err
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    assert run(["--load", str(checkpoint), "--input-file", str(bad)], capsys)[2].count(f"{bad}:2: not JSON") == 1
    code, _, err = run(["--load", str(checkpoint), "--prompt", ""], capsys)
    assert code == 2 and "--prompt: the prompt is empty" in err
    bare = tmp_path / "bare"  # an export carries its tokenizer (test_export_stands_alone.py); a folder without one
    shutil.copytree(hf_folder, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    code, _, err = run(["--load", str(bare), "--prompt", "x"], capsys)
    assert code == 2 and "has no tokenizer files" in err and "--tokenizer-model" in err
    code, _, err = run(["--load", str(checkpoint), "--prompt", "x", "--lr", "0.1"], capsys)
    assert code == 2 and "--lr" in err and "training" in err


def test_a_user_scripts_checkpoint_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from tests.e2e.test_user_scripts import TINY_TEMPLATES, run_script

    save = tmp_path / "save"
    run_script(tmp_path, TINY_TEMPLATES.format(base="Trainer"), monkeypatch, "--epochs", "1", "--lr", "0.1",
               "--micro-batch-size", "4", "--global-batch-size", "8", "--num-workers", "0", "--save", str(save))
    capsys.readouterr()
    code, _, err = run(["--load", str(save), "--prompt", "x"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds no built-in GPT" in err and "user script's own model (Regression, 5 parameters)" in err


# ---- runtime flags: each takes effect (named in the first line, seen in the loaded model) or is refused ----


def loaded_with(load, **flags):
    from rapidtrain.train.generation.loading import load_model
    from rapidtrain.train.generation.runtime import GenerateOptions, resolve_runtime

    options = GenerateOptions(load=str(load[0]), **flags)
    return load_model(options, lambda builtin: resolve_runtime(options, builtin), list(load[1:]))[0]


def test_runtime_flags_change_the_loaded_model(trained):
    import bitsandbytes as bnb

    checkpoint, hf_folder, tokenizer = trained
    # Linear layers: built-in q, k, v, o, fc1, fc2 in 2 layers; GPT-2 fuses q, k, v (c_attn, c_proj, c_fc, c_proj).
    for load, linear_layers in (([checkpoint], 12), ([hf_folder, *tokenizer], 8)):
        plain = loaded_with(load)
        assert {p.dtype for p in plain.model.parameters()} == {torch.float32}
        assert {p.dtype for p in loaded_with(load, bf16=True).model.parameters()} == {torch.bfloat16}
        for flag, kind in (("load_in_8bit", bnb.nn.Linear8bitLt), ("load_in_4bit", bnb.nn.Linear4bit)):
            quantised = loaded_with(load, **{flag: True})
            assert sum(isinstance(m, kind) for m in quantised.model.modules()) == linear_layers
    kernels = {m.kernel for m in loaded_with([checkpoint], attention_backend="eager").model.modules()
               if hasattr(m, "kernel")}
    assert kernels == {"eager"}
    assert loaded_with([hf_folder, *tokenizer], attention_backend="eager").model.config._attn_implementation == "eager"


@pytest.mark.parametrize("flags, words", [
    ([], "device cpu | dtype fp32 | attention auto: torch scaled_dot_product_attention"),
    (["--attention-backend", "eager"], "attention eager: explicit softmax"),
    (["--bf16"], "dtype bf16"),
    (["--load-in-8bit"], "quantization bitsandbytes LLM.int8() 8-bit weights in 12 linear layers"),
    (["--load-in-4bit", "--batch-size", "2"], "batch size 2 | quantization bitsandbytes NF4 4-bit"),
])
def test_the_first_line_names_what_runs(trained, capsys, flags, words):
    if "--bf16" in flags and not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("this CPU has no native bf16 (the refusal is tested below)")
    code, out, err = run(["--load", str(trained[0]), "--prompt", "Once upon a time", "--max-new-tokens", "4",
                          *flags], capsys)
    assert code == 0, err
    assert words in err.splitlines()[0] and out.startswith("Once upon a time")


@pytest.mark.parametrize("flags, words", [
    (["--fp16"], "--fp16 on a CPU: CPUs have no native fp16 arithmetic"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 both choose the dtype"),
    (["--device", "cuda"], "--device cuda: no CUDA device here"),
    (["--split-layers"], "--split-layers spreads the model's layers over several GPUs"),
    (["--torch-compile", "--no-kv-cache"], "--no-kv-cache recomputes a growing sequence"),
    (["--torch-compile", "--attention-backend", "flex_attention"], "which only sdpa (auto) and eager take"),
    (["--load-in-4bit", "--load-in-8bit"], "give one"),
    (["--attention-backend", "fused"], "cuDNN's fused attention, a CUDA kernel"),
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
])
def test_flags_that_cannot_take_effect_here_are_refused(trained, capsys, flags, words):
    if torch.cuda.is_available() and flags[0] in ("--device", "--split-layers"):
        pytest.skip("this machine has CUDA")
    code, _, err = run(["--load", str(trained[0]), "--prompt", "x", *flags], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # compiling the step: ~20 s on 2 shared cores
def test_torch_compile_names_itself_and_decodes_what_the_uncompiled_command_does(trained, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    outputs = []
    for flags in ([], ["--torch-compile"]):
        code, out, err = run(["--load", str(trained[0]), "--input-file", str(prompts_file), "--batch-size", "4",
                              "--max-new-tokens", "8", *flags], capsys)
        assert code == 0, err
        outputs.append(out)
    assert "compile torch.compile (mode default) of the one-token step, static KV cache" in err.splitlines()[0]
    assert outputs[1] == outputs[0] and len(outputs[0].splitlines()) == len(PROMPTS)


def test_torch_compile_is_refused_for_a_hugging_face_folder(trained, capsys):
    _, hf_folder, tokenizer = trained
    code, _, err = run(["--load", str(hf_folder), *tokenizer, "--prompt", "x", "--torch-compile"], capsys)
    assert code == 2 and "a Hugging Face folder decodes through transformers' own cache" in err


def test_bf16_is_refused_on_a_cpu_without_native_bf16(trained, capsys, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)  # the probe of a CPU not this one
    code, _, err = run(["--load", str(trained[0]), "--prompt", "x", "--bf16"], capsys)
    assert code == 2 and "no native bf16 instructions" in err


def test_flash_attention_2_is_refused_for_a_hugging_face_model_on_cpu(trained, capsys):
    _, hf_folder, tokenizer = trained
    code, _, err = run(["--load", str(hf_folder), *tokenizer, "--prompt", "x", "--attention-backend",
                        "flash_attention_2"], capsys)
    assert code == 2 and "needs a CUDA device and the flash_attn package" in err


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_temperature_is_refused_by_name(tmp_path, value, capsys):
    """NaN passes `temperature < 0`; the parser refuses it before any model loads."""
    from rapidtrain.train.generation.command import generation_parser

    with pytest.raises(SystemExit) as refused:
        generation_parser().parse_known_args(["--load", str(tmp_path), "--prompt", "x", "--temperature", value])
    assert refused.value.code == 2
    assert f"argument --temperature: '{value}' is not a finite number" in capsys.readouterr().err
