"""Text from a trained built-in GPT (GPT-2-style or Llama-family): greedy decoding or sampling with
temperature, top-k and top-p, one new token per step through a KV cache.

`rapidtrain generate --load CKPT --prompt "..."` loads a checkpoint of any layout into one process (the
distributed checkpoint reshards TP/PP/EP/FSDP shards) with the flags it was saved with; model and tokenizer
flags given on the command line override those. `generate_sample` is the short sample a training script
prints at its end.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rapidtrain.models.transformer import KVCache


@dataclass(frozen=True)
class SamplingSettings:
    """How each next token is chosen. temperature 0 is greedy (the most likely token); above 0 tokens are
    sampled from softmax(logits / temperature), restricted to the top_k most likely (0: all) and to the
    smallest set whose probability reaches top_p (1.0: all)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_new_tokens: int = 0  # end of document is not chosen before this many new tokens (HF's min_new_tokens)

    def problems(self) -> list[str]:
        found = []
        if self.max_new_tokens < 1:
            found.append(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            found.append(f"--temperature {self.temperature} must be 0 (greedy) or positive")
        if self.top_k < 0:
            found.append(f"--top-k {self.top_k} must be 0 (off) or positive")
        if not 0 < self.top_p <= 1:
            found.append(f"--top-p {self.top_p} must lie in (0, 1]")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            found.append("--top-k / --top-p filter sampling; greedy decoding (--temperature 0) has nothing to "
                         "filter: give --temperature > 0 (e.g. 0.8)")
        return found


def next_token(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None) -> torch.Tensor:
    """The next token [b] from the last position's logits [b, V] (fp32)."""
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / settings.temperature
    if settings.top_k:
        kth = logits.topk(min(settings.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens more likely than it already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= settings.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_decoder(model: nn.Module) -> None:
    if getattr(model, "embedding", None) is None or getattr(model, "output", None) is None:
        raise ValueError(
            "generation needs the whole built-in GPT (embedding and output head): a pipeline stage holds only "
            "part of it. Save a checkpoint and run `rapidtrain generate --load DIR`, which loads it whole."
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    settings: SamplingSettings,
    *,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """prompt [b, s] → [b, s + new] token ids. Ids ≥ `vocab_size` (the padded embedding rows no tokenizer
    id maps to) are never chosen; a row that produced `eos_id` keeps producing it; decoding stops when every
    row has. `use_cache=False` recomputes the whole sequence each step (the reference the cache must match)."""
    _check_decoder(model)
    config = model.config
    limit = prompt.shape[1] + settings.max_new_tokens
    if config.position_embedding_type == "learned_absolute" and limit > config.max_position_embeddings:
        raise ValueError(f"prompt ({prompt.shape[1]} tokens) + --max-new-tokens {settings.max_new_tokens} exceeds "
                         f"the model's {config.max_position_embeddings} learned positions: shorten one of them")
    was_training = model.training
    model.eval()
    cache = KVCache() if use_cache else None
    tokens, step_input = prompt, prompt
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    try:
        for step in range(settings.max_new_tokens):
            logits = model(step_input, kv_cache=cache)
            if hasattr(logits, "full_tensor"):  # tensor parallel: logits split over the vocabulary
                logits = logits.full_tensor()
            logits = logits[:, -1].float()
            if vocab_size is not None and vocab_size < logits.shape[-1]:
                logits[:, vocab_size:] = float("-inf")
            if eos_id is not None and step < settings.min_new_tokens:
                logits[:, eos_id] = float("-inf")
            chosen = next_token(logits, settings, generator)
            if eos_id is not None:
                chosen = torch.where(finished, torch.full_like(chosen, eos_id), chosen)
                finished |= chosen == eos_id
            tokens = torch.cat([tokens, chosen[:, None]], dim=1)
            step_input = chosen[:, None] if use_cache else tokens
            if eos_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return tokens


def generate_sample(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 32) -> str:
    """The prompt and the model's greedy continuation, as text: what a training script prints at its end.

    `model` may be wrapped (DDP, torch.compile); a tensor-parallel model must be called on every rank of its
    group (each runs its heads); a pipeline stage cannot generate alone.
    """
    from rapidtrain.parallel.data_parallel import unwrap

    model = unwrap(model)
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer.tokenize(prompt)], device=device)
    # The whole length: a briefly trained model often ends the document at once, which would print the prompt alone.
    settings = SamplingSettings(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    tokens = generate(model, ids, settings, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eod)
    return prompt + continuation(tokenizer, tokens[0].tolist(), ids.shape[1])


def continuation(tokenizer: Any, tokens: list[int], prompt_length: int) -> str:
    """The text the new tokens add, up to end-of-document; decoded with the prompt so that word boundaries
    (SentencePiece's leading spaces) come out right."""
    new = tokens[prompt_length:]
    if tokenizer.eod is not None and tokenizer.eod in new:
        new = new[: new.index(tokenizer.eod)]
    before = tokenizer.detokenize(tokens[:prompt_length])
    return tokenizer.detokenize(tokens[:prompt_length] + new)[len(before):]


# ---- `rapidtrain generate` ----


def generation_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rapidtrain generate",
        description="Continue a prompt with a trained built-in GPT. Model and tokenizer flags default to the "
                    "ones the checkpoint was saved with; give them to override (e.g. --tokenizer-model on "
                    "another machine).",
        allow_abbrev=False,
    )
    parser.add_argument("--load", required=True, help="A --save folder (its latest iteration) or one iter_* folder.")
    parser.add_argument("--iteration", type=int, default=None, help="Load this iteration instead of the latest.")
    parser.add_argument("--prompt", required=True, help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to add (default 32).")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; above 0: sample from softmax(logits / temperature).")
    parser.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0: all).")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="Sample among the most likely tokens whose probability reaches p (1.0: all).")
    parser.add_argument("--seed", type=int, default=1234, help="Seed of the sampling generator.")
    parser.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                        help="Recompute the whole sequence each step instead of caching keys and values.")
    return parser


def load_for_generation(options: argparse.Namespace, overrides: list[str]) -> tuple[nn.Module, Any]:
    """The checkpoint's built-in GPT, whole, in this process, and its tokenizer (as the run's plan saved them;
    tokenizer flags given override the saved files' paths, shape flags must agree with the checkpoint)."""
    from rapidtrain.checkpoint.checkpointer import CheckpointError, check_same_model, read_common
    from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state
    from rapidtrain.config.arguments import build_parser, given_flags
    from rapidtrain.config.resolve import model_config_from_args
    from rapidtrain.config.saved_checkpoint import saved_model_config
    from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer
    from rapidtrain.models import build_model

    directory = checkpoint_directory(options.load, options.iteration)
    config = saved_model_config(directory)
    if config is None or config.model_type != "gpt":
        raise CheckpointError(f"{directory} holds no built-in GPT: `rapidtrain generate` continues text with the "
                              "built-in GPT (GPT-2-style or Llama-family)")
    parser = build_parser()
    values = vars(parser.parse_args(overrides))
    given = given_flags(parser, overrides)
    common = read_common(directory)
    saved_args = common.get("args", {})
    args = argparse.Namespace(**(values | {k: v for k, v in saved_args.items() if k not in given}))
    if given & {f.name for f in dataclasses.fields(config)} | given & set(saved_args):
        wanted = model_config_from_args(args, config.vocab_size)
        check_same_model(dataclasses.asdict(config), dataclasses.asdict(wanted), directory)
    model = build_model(config, seed=None)
    model.load_state_dict(consolidated_model_state(directory), strict=True)
    saved_tokenizer = (common.get("plan") or {}).get("tokenizer")
    if saved_tokenizer is None and args.tokenizer_type is None:
        raise CheckpointError(f"{directory} was saved without a tokenizer: give the tokenizer flags")
    fields = {f.name for f in dataclasses.fields(TokenizerSettings)}
    settings = {name: value for name, value in (saved_tokenizer or {}).items() if name in fields}
    settings.update({name: getattr(args, name) for name in fields & given})  # the flags' names are the fields'
    if "tokenizer_type" not in settings:
        settings.update({name: getattr(args, name) for name in fields if hasattr(args, name)})
    return model.eval(), build_tokenizer(TokenizerSettings(**settings))


def generate_command(argv: list[str]) -> int:
    from rapidtrain.checkpoint.checkpointer import CheckpointError
    from rapidtrain.data.tokenizer import TokenizerSettingsError

    options, overrides = generation_parser().parse_known_args(argv)
    settings = SamplingSettings(options.max_new_tokens, options.temperature, options.top_k, options.top_p)
    if settings.problems():
        print("rapidtrain generate: " + "; ".join(settings.problems()), file=sys.stderr)
        return 2
    try:
        model, tokenizer = load_for_generation(options, overrides)
        prompt = torch.tensor([tokenizer.tokenize(options.prompt)])
        tokens = generate(model, prompt, settings, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eod,
                          use_cache=options.kv_cache, generator=torch.Generator().manual_seed(options.seed))
    except (CheckpointError, TokenizerSettingsError, ValueError) as error:
        print(f"rapidtrain generate: {error}", file=sys.stderr)
        return 2
    print(options.prompt + continuation(tokenizer, tokens[0].tolist(), prompt.shape[1]))
    return 0
