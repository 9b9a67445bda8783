"""Every flag rapidtrain accepts, grouped as Rapidformer's reference groups them.

Each help string says what the flag does and which engine serves it; this file is the one place flags
are declared (the help text is their documentation). `parse_args` returns a plain namespace; the
conflict table (`rules.py`) and the plan (`plan.py`) read it, nothing else does.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence

# The tokenizer module owns the list of types (it imports only the standard library at load time).
from rapidtrain.config.flag_parser import FlagParser
from rapidtrain.config.pipeline_split import SCHEDULES
from rapidtrain.config.settings import MEGATRON_TASKS, RECOMPUTE_MODULE_MEANINGS
from rapidtrain.data.tokenizer import TOKENIZER_TYPES
from rapidtrain.optim.muon import MUON_SCALE_MODES

TASKS = (
    "sequence_classification",
    "token_classification",
    "question_answering",
    "masked_lm",
    "casual_lm",
    "seq2seq_lm",
    "pretraining",
    *MEGATRON_TASKS,
)
# Rapidformer spells it `casual_lm`; users who type the correct spelling get the same task.
TASK_ALIASES = {"causal_lm": "casual_lm"}

OPTIMIZERS_RAPIDFORMER = ("apex_adam", "apex_lamb")
OPTIMIZERS = ("apex_adam", "apex_lamb", "adamw", "adam", "adafactor", "sgd", "adamw_8bit", "paged_adamw_8bit",
              "adamw_4bit", "muon", "dist_muon")
RECOMPUTE_GRANULARITIES = ("full", "selective", "op")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

# Megatron-LM's --exit-signal choices (signal names), and those a run can catch and stop on: SIGKILL and SIGSTOP
# cannot be caught, SIGCHLD/SIGCONT/SIGWINCH/SIGURG come with normal operation (a child ending, a job resumed, a
# resized terminal), and the fault signals (SIGSEGV, SIGBUS, ...) mean the process is already broken.
MEGATRON_SIGNAL_NAMES = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGKILL",
                         "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM", "SIGSTKFLT", "SIGCHLD",
                         "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGXCPU", "SIGXFSZ",
                         "SIGVTALRM", "SIGPROF", "SIGWINCH", "SIGIO", "SIGPWR", "SIGSYS", "SIGRTMIN", "SIGRTMAX")
CATCHABLE_EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU",
                          "SIGPWR")



def canonical_task(value: str) -> str:
    """`--task` value in Rapidformer's spelling; unknown values pass through for the rules to report."""
    return TASK_ALIASES.get(value, value)


def num_experts_list(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"--num-experts takes non-negative integers, got {value}")
    return number


def router_type(value: str) -> int | str:
    """Rapidformer's --router-type 0, or Pai-Megatron-Patch's name for the same router (topk)."""
    return 0 if value == "topk" else int(value) if value.isdigit() else value


def moe_layer_pattern(value: str) -> int | list[int]:
    """Megatron-Core's --moe-layer-freq: N (every Nth layer), or a per-layer 0/1 pattern written as a list
    ('[1,0,1,0]') or as Megatron's list expression ('([0]*3+[1]*58)'), read without evaluating anything."""
    text = value.strip().replace(" ", "")
    if re.fullmatch(r"\d+", text):
        return int(text)
    text = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    pattern: list[int] = []
    for term in text.split("+"):
        found = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*(\d+))?", term)
        if not found:
            raise argparse.ArgumentTypeError(f"--moe-layer-freq {value}: give N, or a 0/1 list such as '[1,0]' or "
                                             "'([0]*3+[1]*5)'")
        pattern += [int(bit) for bit in found.group(1).split(",")] * int(found.group(2) or 1)
    return pattern


def _add_data(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data", "Regular settings: data (Megatron indexed data or a fine-tuning set)")
    g.add_argument("--micro-batch-size", type=int, default=1,
                   help="Samples per data-parallel rank per forward/backward (Rapidformer default 1).")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples over all ranks per optimizer step; accumulation steps = global / (micro × "
                        "data-parallel "
                        "size). Default: micro × data-parallel size (Megatron's rule; 1 on one device).")
    g.add_argument("--auto-micro-batch-size", action="store_true",
                   help="Choose the largest micro batch that fits --memory-budget-gb (model state + micro × an "
                        "estimated per-sample activation cost, recompute counted) among those dividing global / "
                        "data-parallel size, keeping --global-batch-size by changing the accumulation steps; the "
                        "plan shows the choice and the arithmetic. --micro-batch-size is the upper bound.")
    g.add_argument("--memory-budget-gb", type=float, default=None,
                   help="Memory per rank (GiB) that --auto-micro-batch-size fits the micro batch into.")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="Tokenizer of the pretraining data (rapidtrain.data.tokenizer). Default: the demo corpus's "
                        "SentencePiece model when no --data-path is given.")
    g.add_argument("--vocab-file", default=None,
                   help="Vocabulary file (GPT2BPETokenizer json, BertWordPiece txt, JiebaBPETokenizer tokenizer.json).")
    g.add_argument("--merge-file", default=None, help="BPE merges file (GPT2BPETokenizer).")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece model file, or a local Hugging Face tokenizer directory.")
    g.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size for NullTokenizer.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this × tensor-parallel size (Megatron).")
    g.add_argument("--split", default="969, 30, 1",
                   help="Train/valid/test weights of the pretraining documents, any separators ('969, 30, 1').")
    g.add_argument("--data-impl", choices=("lazy", "cached", "mmap", "infer"), default="mmap",
                   help="Indexed dataset implementation: mmap (MMIDIDX), lazy/cached (legacy TNTIDX), infer "
                        "(by magic).")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Pretraining data prefix (PREFIX.bin/.idx), or 'w1 p1 w2 p2 ...' for a weighted blend. "
                        "Absent: the built-in demo corpus.")
    g.add_argument("--data-cache-path", default=None, help="Folder for the dataset index caches (.npy).")
    g.add_argument("--data-dir", default=None, help="Fine-tuning dataset folder (GLUE-style files or save_to_disk).")
    g.add_argument("--data-name", default=None, help="Fine-tuning dataset name under --data-dir, e.g. mrpc.")
    g.add_argument("--dataset-name", default=None, help="Alias of --data-name used by some Rapidformer scripts.")
    _add_data_streams(g)


def _add_data_streams(g: argparse._ArgumentGroup) -> None:
    """The data group's second half: batching by length, loader workers, document masking, BERT sampling, per-split
    paths and task files, batch-size ramp-ups."""
    g.add_argument("--data-iterator", choices=("dynamic-shape",), default=None,
                   help="dynamic-shape: bucket samples by length and pad each batch to its longest (multiple of 8) "
                        "instead of fixed --seq-length padding (rapidtrain.data.dynamic_shape).")
    g.add_argument("--padding-free", action="store_true",
                   help="casual_lm fine-tuning: concatenate each micro-batch's sequences into one row with position "
                        "ids restarting at 0 per sequence and no attention mask (Hugging Face's "
                        "DataCollatorWithFlattening, TRL's padding_free): no padded tokens, and the model's mask "
                        "keeps each sequence to itself.")
    g.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader worker processes per rank. Default: 0 (batches made in the training process) on "
                        "a CPU reading indexed or demo data, where a sample is a slice of a memory-mapped file and a "
                        "worker would only add its hand-over and take a core from the computation; else 2. The plan "
                        "says which and why.")
    g.add_argument("--eod-mask-loss", action="store_true", help="No loss on end-of-document labels.")
    g.add_argument("--reset-position-ids", action="store_true", help="Restart position ids after each end of document.")
    g.add_argument("--reset-attention-mask", action="store_true", help="Block attention across end of document.")
    g.add_argument("--mask-prob", type=float, default=0.15, help="BERT: fraction of tokens masked (80/10/10).")
    g.add_argument("--short-seq-prob", type=float, default=0.1, help="BERT: probability of a shorter sample.")
    g.add_argument("--train-data-path", nargs="*", default=None,
                   help="Megatron's separate splits: indexed data (a prefix or 'w1 p1 w2 p2 ...') for training only; "
                        "with it --split does not apply. --valid-data-path / --test-data-path give the others.")
    g.add_argument("--valid-data-path", nargs="*", default=None, help="Indexed data for validation only.")
    g.add_argument("--test-data-path", nargs="*", default=None, help="Indexed data for the final test only.")
    g.add_argument("--train-data", nargs="+", default=None,
                   help="Megatron tasks / Rapidformer fine-tuning data files (get_args().train_data; GPTFinetuner's "
                        "GPTDataset reads text lines). In the built-in pretraining: --train-data-path.")
    g.add_argument("--valid-data", nargs="*", default=None, help="Validation files (see --train-data).")
    g.add_argument("--test-data", nargs="*", default=None, help="Test files (see --train-data).")
    g.add_argument("--keep-last", action="store_true",
                   help="Fine-tuning (Megatron tasks): keep the last, incomplete micro-batch of each epoch instead of "
                        "dropping it.")
    g.add_argument("--mmap-warmup", action="store_true",
                   help="Read every page of the indexed data once before training (Megatron's mmap warm-up).")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Megatron's batch-size ramp-up: the global batch starts at START and grows by INCREMENT in "
                        "equal steps over the first SAMPLES samples to --global-batch-size (accumulation steps grow).")
    g.add_argument("--step-batch-size-schedule", nargs="+", default=None,
                   help="Megatron's step schedule 'THRESHOLD:BATCH ...' (K/M/B/T suffixes; thresholds in tokens, "
                        "divided by --seq-length; the first is 0): the global batch of the last threshold reached.")


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local", "eager", "sdpa", "flash_attention_2",
                      "flex_attention")  # models/attention_backends.NAMES, which a test keeps equal


def _add_transformer(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("transformer", "Regular settings: transformer (built-in Megatron-style models)")
    g.add_argument("--pretrained-model-name-or-path", default=None,
                   help="Local Hugging Face model folder (never the hub). Fine-tuning tasks load it with transformers' "
                        "Auto classes; --task pretraining starts the built-in model from its weights (GPT-2, BLOOM, "
                        "Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen-MoE, DeepSeek-V2/V3, gpt-oss, BERT), shape "
                        "flags not given taken from its config.json.")
    g.add_argument("--model-type", choices=("gpt", "bert"), default="gpt", help="Built-in model to pretrain.")
    g.add_argument("--num-layers", type=int, default=4, help="Transformer layers (default: the demo model's 4).")
    g.add_argument("--hidden-size", type=int, default=256,
                   help="Hidden dimension (default 256; the demo corpus's model: 128).")
    g.add_argument("--num-attention-heads", type=int, default=4, help="Self-attention heads (default 4).")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default 4 × hidden).")
    g.add_argument("--seq-length", type=int, default=256, help="Sequence length of training samples (default 256).")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Rows of the position-embedding table (default: --seq-length).")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "alibi"),
                   default="learned_absolute",
                   help="Learned absolute positions (Megatron GPT default), rotary embeddings, or ALiBi's per-head "
                        "linear biases on the attention scores (BLOOM; GPT only, no position embeddings).")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after attention and MLP.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight initialisation.")
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", type=float, default=1e-5,
                   help="Epsilon of LayerNorm and RMSNorm.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate output-layer weights instead of the tied input embedding.")
    _add_transformer_variants(g)


def _add_transformer_variants(g: argparse._ArgumentGroup) -> None:
    """The model group's second half: BERT's binary head, Megatron-Core model switches, the Llama-family variants
    (normalization, SwiGLU, grouped-query attention, biases, rotary settings) and the attention backend."""
    g.add_argument("--bert-binary-head", action="store_true", default=None,
                   help="BERT: the sentence-order (binary) head on the pooled [CLS]; on by default for BERT, as in "
                        "Megatron (its data must be sentence-split: preprocess_data.py --split-sentences).")
    g.add_argument("--bert-no-binary-head", dest="bert_binary_head", action="store_false",
                   help="BERT without the binary head (Megatron's flag): masked-LM loss only, any data.")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="Megatron's choice of model implementation; rapidtrain has one (the plan says so).")
    g.add_argument("--use-legacy-models", action="store_true",
                   help="Megatron's choice of model implementation; rapidtrain has one (the plan says so).")
    # Llama-family architecture, with Megatron's flag names.
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm",
                   help="Norm of every layer, the final norm and BERT's head (Llama: RMSNorm).")
    g.add_argument("--swiglu", action="store_true",
                   help="Gated MLP fc2(silu(gate(x)) · fc1(x)) in dense layers and experts (Llama); without "
                        "--ffn-hidden-size the MLP is 2/3 of 4 × hidden, rounded down to a multiple of 64 (Megatron).")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Grouped-query attention: --num-query-groups key/value heads shared by the query heads.")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="Key/value heads with --group-query-attention (default 1); divides the heads, and is "
                        "divisible by the tensor-parallel size.")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="No biases in attention, MLP and expert linear layers (Llama).")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="With --disable-bias-linear: biases on the q/k/v projections only (Qwen2).")
    g.add_argument("--rotary-base", type=float, default=None,
                   help="Rotary base theta with --position-embedding-type rope (default 10000).")
    g.add_argument("--rotary-percent", type=float, default=None,
                   help="Share of each head's dimensions that rope rotates (default 1.0).")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="Rope rotates adjacent dimensions (2i, 2i + 1) as one pair (GPT-J's layout) instead of (i, i + "
                        "rotary dim / 2) (Megatron's default, Llama's rotate_half).")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Size of each attention head (default --hidden-size / --num-attention-heads); q/k/v project "
                        "hidden → heads × kv-channels and o_proj back (Qwen3: 128).")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="A norm (--normalization's kind) on each head's queries and keys before rope, one weight of "
                        "--kv-channels shared by the heads (Qwen3, OLMo 2).")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1's rope scaling: long-wavelength pairs slowed by --rope-scaling-factor, short ones "
                        "kept, those between blended (low/high frequency factors 1 and 4, original context 8192, as "
                        "Megatron).")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="Llama 3.1's rope scaling factor with --use-rope-scaling (default 8).")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="Linear position interpolation: rope sees positions / this factor (default 1: none).")
    g.add_argument("--rope-type", choices=("rope", "yarn"), default=None,
                   help="Rotary kind: plain rope, or YaRN (arXiv 2309.00071; DeepSeek-V2/V3, Qwen): pairs turning "
                        "between --yarn-beta-slow and --yarn-beta-fast times over the original context blended from "
                        "their frequency to it / --rotary-scaling-factor, cos/sin scaled by mscale. Default rope; "
                        "with --multi-latent-attention YaRN (Megatron-Core's MLA default; a factor of 1 is plain "
                        "rope).")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN's context-stretch factor with --rope-type yarn (DeepSeek-V3: 40; default 1: none).")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN: cos/sin are scaled by mscale(factor, this) / mscale(factor, --mscale-all-dim), "
                        "mscale(s, m) = 0.1·m·ln(s) + 1 (default 1).")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN's second mscale (see --mscale); with --multi-latent-attention the softmax scale is "
                        "also multiplied by mscale(factor, this)², as DeepSeek (default 0: 1).")
    g.add_argument("--yarn-beta-fast", type=float, default=None,
                   help="YaRN: pairs turning more than this many times over the original context keep their "
                        "frequency (default 32).")
    g.add_argument("--yarn-beta-slow", type=float, default=None,
                   help="YaRN: pairs turning fewer than this many times are divided by the factor (default 1).")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN: the context the model was trained with before stretching (default 4096, "
                        "Megatron-Core's MLA default).")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="YaRN: round the blend's first and last pair to whole pairs (the default).")
    g.add_argument("--no-yarn-correction-range-round-to-int", dest="yarn_correction_range_round_to_int",
                   action="store_false", help="YaRN: keep the blend's ends fractional (Hugging Face's truncate=false).")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="Multi-head latent attention (DeepSeek-V2/V3): queries through --q-lora-rank, keys and "
                        "values from a --kv-lora-rank latent, each head's query/key a --qk-head-dim part and a "
                        "--qk-pos-emb-head-dim rotary part (the rotary key shared by the heads), values of "
                        "--v-head-dim; --qk-layernorm puts a norm on both latents (DeepSeek). Needs rope positions.")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="MLA: rank of the query bottleneck (DeepSeek-V3: 1536); default none: one query projection.")
    g.add_argument("--kv-lora-rank", type=int, default=32,
                   help="MLA: size of the key/value latent per token (DeepSeek-V3: 512; default 32, Megatron's).")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="MLA: the unrotated part of each head's query and key (DeepSeek: 128; Pai-Megatron-Patch's "
                        "--qk-nope-head-dim).")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="MLA: the rotary part of each head's query and of the shared key (DeepSeek: 64; "
                        "Pai-Megatron-Patch's --qk-rope-head-dim).")
    g.add_argument("--v-head-dim", type=int, default=128, help="MLA: each head's value size (DeepSeek: 128).")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GELU's tanh approximation (GPT-2's gelu_new) instead of the exact GELU.")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="Attention kernel, by Megatron's names (auto, flash, fused = cuDNN, unfused/local = explicit "
                        "softmax(QKᵀ)V) or Hugging Face's attn_implementation names (eager, sdpa, flash_attention_2, "
                        "flex_attention). Built-in models run torch SDPA (auto/sdpa; flash/fused pin its flash/cuDNN "
                        "backend), the explicit form, or FlexAttention (--reset-attention-mask then masks by document "
                        "ids through a block-sparse mask); Hugging Face models load with that attn_implementation. "
                        "The plan says which kernel runs; one the device cannot run is refused.")
    g.add_argument("--embed-layernorm", action="store_true",
                   help="A LayerNorm on the word embeddings, before anything is added to them (BLOOM, "
                        "Megatron-DeepSpeed).")
    g.add_argument("--sliding-window", type=int, default=None,
                   help="Sliding-window attention (Mistral; GPT only): each query sees itself and the keys before it, "
                        "at most this many in all (Megatron's --window-size L,0 is L + 1).")
    _add_gpt_oss_variants(g)
    g.add_argument("--post-layernorm", action="store_true",
                   help="Original BERT order: x = norm(x + f(x)) in every layer, a norm on the embedding sum and "
                        "no final norm (Hugging Face BERT). Default: pre-norm, as Megatron.")


def _add_gpt_oss_variants(g: argparse._ArgumentGroup) -> None:
    """gpt-oss's switches, with Megatron-Core's names: attention sinks and the clamped quick-GEGLU."""
    g.add_argument("--softmax-type", choices=("vanilla", "off-by-one", "learnable"), default="vanilla",
                   help="Attention's softmax: vanilla; off-by-one adds 1 to its denominator (an attention sink of "
                        "logit 0); learnable adds exp of a learned logit per head (gpt-oss's sinks). Every kernel: "
                        "SDPA takes the sink as one more key of zero value (a float mask), eager as one more softmax "
                        "column, FlexAttention by rescaling with its logsumexp.")
    g.add_argument("--squared-relu", action="store_true",
                   help="Squared ReLU, relu(x)², as the activation of MLPs without a gate, dense and experts "
                        "(Megatron's Nemotron runs; Primer); excludes --swiglu, --quick-geglu and --openai-gelu.")
    g.add_argument("--quick-geglu", action="store_true",
                   help="Gated MLP fc2(quick_gelu(gate(x)) · fc1(x)) with quick_gelu(x) = x·sigmoid(1.702x), in dense "
                        "layers and experts (gpt-oss; Megatron-Core's quick-GEGLU); excludes --swiglu. With biases (no "
                        "--disable-bias-linear) MoE routers get a bias too, as Megatron-Core's and gpt-oss's.")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="Added to the gated MLP's linear half before the product: act(gate) · (linear + offset) "
                        "(gpt-oss: 1); needs --swiglu or --quick-geglu.")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="The gated MLP's clamp: the gate clamped above at this value, the linear half to ± it, "
                        "before the activation (gpt-oss: 7); needs --swiglu or --quick-geglu.")


def _add_training(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training", "Regular settings: training")
    g.add_argument("--task", type=canonical_task, default="pretraining",
                   help=f"Training task: {', '.join(TASKS)} ('causal_lm' is accepted for casual_lm). MNLI and RACE are "
                        "Megatron's tasks/main.py (rapidtrain/tasks_main.py): the built-in BERT from "
                        "--pretrained-checkpoint, on --train-data / --valid-data files.")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor after decay.")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear",
                   help="Decay after warm-up (Megatron semantics, counted in samples).")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Decay horizon in iterations (default "
                                                                    "--train-iters).")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="Warm-up as a fraction of the decay horizon.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Warm-up in iterations.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="The learning rate the warm-up starts from (Megatron's; default 0).")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD: iterations of the final decay phase.")
    g.add_argument("--lr-wsd-decay-style", choices=("linear", "cosine", "exponential", "minus_sqrt"),
                   default="linear", help="WSD: the shape of the final decay phase (Megatron-Core's).")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Sample-based training (Megatron): samples to train on; the iterations follow from the global "
                        "batch (and its ramp-up). Use the -samples forms of the schedule flags with it.")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Decay horizon in samples (sample-based training; default --train-samples).")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="Warm-up in samples (sample-based training).")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="WSD: samples of the final decay phase (sample-based training).")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay (none on biases and norms).")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="Clip the global gradient norm to this (0 turns clipping off; DeepSpeed gradient_clipping).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    _add_training_controls(g)


def _add_training_controls(g: argparse._ArgumentGroup) -> None:
    """The training group's second half: length (iterations or epochs), seed and evaluation, the user script, LoRA
    and k-bit bases, exit conditions, Rapidformer's app flags and the distributed backend."""
    g.add_argument("--train-iters", type=int, default=None, help="Iterations (iteration-based training).")
    g.add_argument("--epochs", type=int, default=None,
                   help="Epochs (epoch-based fine-tuning: the Hugging Face tasks, a Finetuner, and the built-in "
                        "model on Pai's SFT JSON, --dataset JSON-SFT / LLama-SFT, whole global batches an epoch).")
    g.add_argument("--seed", type=int, default=1234, help="Random seed (weights, data order, dropout).")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="Iterations between evaluations (default: 1000 in pretraining, as Megatron; in fine-tuning "
                        "evaluation runs after each epoch, and also every N steps when this is given).")
    g.add_argument("--eval-iters", type=int, default=10, help="Batches per evaluation.")
    g.add_argument("--user-script", default=None,
                   help="White-box script subclassing Finetuner / PreTrainer / Trainer, run under torchrun.")
    g.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA adapters of this rank, the rest frozen: peft's on a Hugging Face model, rapidtrain's on "
                        "the built-in model (split with their layers under tensor parallelism, folded into the "
                        "weights on export); 0 = off.")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help="LoRA scaling numerator: adapters add (alpha / rank) · B·A·x (peft lora_alpha). "
                        "Default 2 × --lora-rank.")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="Dropout on the LoRA adapters' input "
                                                                   "(peft lora_dropout).")
    g.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="Module names that get adapters (peft target_modules, e.g. query value), or all-linear. "
                        "Default: peft's choice for the architecture, every linear layer where it has none.")
    g.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA: load the frozen base model in 4-bit NF4 with double quantisation (bitsandbytes via "
                        "transformers BitsAndBytesConfig, peft prepare_model_for_kbit_training); needs --lora-rank.")
    g.add_argument("--load-in-8bit", action="store_true",
                   help="Load the frozen base model in 8-bit (bitsandbytes LLM.int8() via transformers "
                        "BitsAndBytesConfig, peft prepare_model_for_kbit_training); needs --lora-rank.")
    g.add_argument("--exit-interval", type=int, default=None, help="Save and exit at an iteration divisible by this.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="Save and exit after this many minutes.")
    g.add_argument("--app-name", default=None,
                   help="Rapidformer/EasyNLP application name, for user scripts (get_args().app_name); rapidtrain's "
                        "templates choose by --task.")
    g.add_argument("--user-defined-parameters", default=None,
                   help="Rapidformer/EasyNLP 'key=value ...' string, for user scripts (get_args()).")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM (and --exit-signal), stop at the end of the iteration and exit 0, saving a "
                        "checkpoint when --save is given (with --save this is always on; without either, SIGTERM "
                        "ends the process at once).")
    g.add_argument("--exit-signal", default="SIGTERM", choices=MEGATRON_SIGNAL_NAMES, metavar="SIGNAL",
                   help="A signal that stops the run as SIGTERM does (Megatron's), such as SIGUSR1 from Slurm's "
                        "--signal=B:USR1@120: the `rapidtrain` launcher forwards it to the ranks, which save (with "
                        "--save) and exit 0, and waits for them. Caught with --save or --exit-signal-handler; one of "
                        f"{', '.join(CATCHABLE_EXIT_SIGNALS)}.")


def _add_distributed(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed", "Launching (torch.distributed.run)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="Collective backend: default nccl on CUDA, gloo on CPU.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Minutes a collective may wait for the other ranks before the run fails (Megatron's flag; "
                        "raise it when rank 0 builds large data indices or saves large checkpoints).")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="Processes per node when rapidtrain starts torchrun itself (default: visible GPUs, or 1).")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--DDP-impl", dest="ddp_impl", choices=("local", "torch"), default=None,
                   help="Megatron's data-parallel wrapper choice; both are served by torch DistributedDataParallel "
                        "(bucketed all-reduce overlapping backward), which averages gradients as Megatron's does.")
    g.add_argument("--no-contiguous-buffers-in-local-ddp", dest="use_contiguous_buffers_in_local_ddp",
                   action="store_false",
                   help="Megatron's local DDP option; torch DDP always packs gradients into its own buckets.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: optimizer state sharded over data-parallel ranks, served by "
                        "torch ZeroRedundancyOptimizer (--oss-memory-optimization), or with tensor/pipeline "
                        "parallelism by FSDP2 over the data-parallel dimension (--zero-1-memory-optimization).")


def _add_parallelism(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "acceleration: 3D parallelism",
        "Megatron-style tensor / pipeline / data parallelism (built-in models only)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="Tensor-parallel size: Megatron column/row splits by DTensor parallelize_module.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="Pipeline stages split by layers: torch.distributed.pipelining, the schedule of "
                        "--pipeline-schedule (1F1B by default), evenly unless a split flag says otherwise.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Interleaved schedules: layers per virtual stage (virtual stages per rank = layers per "
                        "pipeline rank / this).")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="Interleaved schedules: model chunks (virtual stages) per pipeline rank, Megatron-Core's "
                        "form of --num-layers-per-virtual-pipeline-stage.")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default=None,
                   help="The pipeline schedule (torch.distributed.pipelining): 1f1b (interleaved with virtual "
                        "stages; GPipe when there are fewer micro-batches than stages), gpipe, zero-bubble (ZB-H1; "
                        "the interleaved ZB1P with virtual stages: backward split into input and weight gradients, "
                        "weight passes filling the bubble), zbv (zero bubble V: two stages per rank in a V), "
                        "dualpipev (DeepSeek's DualPipeV, two stages per rank in a V). Default 1f1b.")
    g.add_argument("--enable-zbh1-pipeline", action="store_true",
                   help="Megatron-DeepSpeed's zero-bubble ZB-H1 schedule: --pipeline-schedule zero-bubble.")
    g.add_argument("--enable-zbh1-exact-semantics", action="store_true",
                   help="Megatron-DeepSpeed's ZB-H1 with 1F1B's order of weight-gradient accumulation: torch's "
                        "zero-bubble schedules run each stage's weight passes in micro-batch order, so "
                        "--pipeline-schedule zero-bubble has it always (needs --enable-zbh1-pipeline).")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Megatron-LM's uneven split: transformer layers on the first pipeline rank (over its virtual "
                        "stages equally); the middle ranks share the rest equally.")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Megatron-LM's uneven split: transformer layers on the last pipeline rank.")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Megatron-LM: the embedding counts as a layer of the pipeline split, so the first stage "
                        "holds one transformer layer fewer.")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Megatron-LM: the loss (final norm and head) counts as a layer of the pipeline split, so the "
                        "last stage holds one transformer layer fewer.")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help="Megatron-Core's explicit layout: each stage's parts, E embedding, t transformer layer, m MTP "
                        "depth, L loss, '|' between stages (virtual stages after the P ranks' first), 'x*n' and "
                        "'(...)*n' repeat, e.g. 'Et*3|(tt|)*29,m|L'.")
    g.add_argument("--pp-partition-method", default=None,
                   help="DeepSpeed's PipelineModule partitioning over Megatron-DeepSpeed's GPT layer list (cast, "
                        "embedding, layers, final norm, head): uniform (items evenly), parameters (balanced by "
                        "parameter counts), type:REGEX (balanced by the items whose class name matches, e.g. "
                        "type:transformer|embedding, BLOOM's).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Shard norms and dropout along the sequence over tensor-parallel ranks (DTensor).")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Context parallelism: each micro-batch's sequence split over this many ranks (2·CP chunks, "
                        "rank r keeps chunks r and 2·CP-1-r, as Megatron-Core), attention exchanged across them "
                        "(--cp-comm-type); DP = world / (TP × PP × CP), gradients reduced over DP × CP ranks.")
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"], choices=("p2p", "a2a", "allgather", "a2a+p2p"),
                   help="How context-parallel ranks exchange attention: p2p (ring: K/V passed around, partial "
                        "results merged by log-sum-exp), allgather (all K/V gathered), a2a (DeepSpeed-Ulysses: "
                        "all-to-all from sequence to head split). One value (a per-layer list must repeat it).")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="Megatron-DeepSpeed's Ulysses sequence parallelism: --context-parallel-size N with "
                        "--cp-comm-type a2a (DP = world / (TP × PP × SP)).")


def _add_memory(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "acceleration: model-state partitioning",
        "Partition optimizer state, gradients and parameters over data-parallel ranks (choose one)")
    g.add_argument("--oss-memory-optimization", action="store_true",
                   help="Optimizer-state sharding: torch ZeroRedundancyOptimizer + DDP.")
    g.add_argument("--oss-sdp-memory-optimization", action="store_true",
                   help="Optimizer state + gradients sharded: FSDP2 fully_shard(reshard_after_forward=False).")
    g.add_argument("--fsdp-memory-optimization", action="store_true",
                   help="Optimizer state, gradients and parameters sharded: FSDP2 fully_shard.")
    g.add_argument("--zero-1-memory-optimization", action="store_true",
                   help="ZeRO-1 (optimizer state): DeepSpeed stage 1; with TP/PP/EP, FSDP2 over the "
                        "data-parallel dimension.")
    g.add_argument("--zero-2-memory-optimization", action="store_true",
                   help="ZeRO-2 (+ gradients): DeepSpeed stage 2; with TP/PP/EP, FSDP2 over the data-parallel "
                        "dimension.")
    g.add_argument("--zero-3-memory-optimization", action="store_true",
                   help="ZeRO-3 (+ parameters): DeepSpeed stage 3, model built under deepspeed.zero.Init.")
    g.add_argument("--cpu-offload", action="store_true",
                   help="Optimizer state and step on the CPU: DeepSpeed offload_optimizer with "
                        "DeepSpeedCPUAdam (ZeRO only).")
    g.add_argument("--cpu-offload-params", action="store_true",
                   help="ZeRO-3 parameter offload: each rank's parameter partition lives in host memory and is "
                        "gathered to the device layer by layer (DeepSpeed offload_param: cpu; needs "
                        "--zero-3-memory-optimization).")
    g.add_argument("--nvme-offload-dir", default=None, metavar="DIR",
                   help="ZeRO-Infinity: optimizer state and parameters offloaded to files in DIR on a fast local disk "
                        "through DeepSpeed's async I/O (offload_optimizer and offload_param: nvme; DeepSpeedCPUAdam "
                        "steps; needs --zero-3-memory-optimization and libaio).")
    g.add_argument("--zero-overlap-comm", action=argparse.BooleanOptionalAction, default=True,
                   help="DeepSpeed ZeRO: overlap gradient reduction with the backward pass (overlap_comm).")
    g.add_argument("--zero-contiguous-gradients", action=argparse.BooleanOptionalAction, default=True,
                   help="DeepSpeed ZeRO: copy gradients into one contiguous buffer as they are produced, against "
                        "fragmentation (contiguous_gradients).")
    g.add_argument("--zero-reduce-bucket-size", type=int, default=500_000_000,
                   help="DeepSpeed ZeRO: elements reduced at once (reduce_bucket_size; DeepSpeed's default).")
    g.add_argument("--zero-allgather-bucket-size", type=int, default=500_000_000,
                   help="DeepSpeed ZeRO-1/2: elements all-gathered at once after the step (allgather_bucket_size).")
    g.add_argument("--zero-stage3-prefetch-bucket-size", type=int, default=50_000_000,
                   help="DeepSpeed ZeRO-3: elements of upcoming layers' parameters fetched ahead "
                        "(stage3_prefetch_bucket_size).")
    g.add_argument("--zero-stage3-param-persistence-threshold", type=int, default=100_000,
                   help="DeepSpeed ZeRO-3: parameters smaller than this many elements stay gathered instead of "
                        "being partitioned (stage3_param_persistence_threshold).")
    g.add_argument("--zero-stage3-max-live-parameters", type=int, default=1_000_000_000,
                   help="DeepSpeed ZeRO-3: most parameter elements kept gathered at once "
                        "(stage3_max_live_parameters).")
    g.add_argument("--sharding-backend", choices=("torch", "fairscale"), default="torch",
                   help="Engine of OSS/SDP: PyTorch (default) or FairScale's OSS/ShardedDDP where it runs.")
    g.add_argument("--deepspeed", action="store_true",
                   help="Megatron-DeepSpeed's switch: DeepSpeed serves the --zero-*-memory-optimization switches; "
                        "with --deepspeed_config its JSON is merged into the generated config.")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                   help="A DeepSpeed JSON config merged with the one generated from the flags (ZeRO only); a key "
                        "the flags also set must agree.")
    g.add_argument("--remote-device", choices=("none", "cpu", "nvme"), default="none",
                   help="Megatron-DeepSpeed's ZeRO-3 parameter placement (get_args().remote_device); only 'none' is "
                        "served (use --cpu-offload for the optimizer state).")


def _add_precision(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("acceleration: precision", "Mixed precision (autocast + fp32 master weights)")
    g.add_argument("--mixed-precision", action="store_true",
                   help="FP16 mixed precision with dynamic loss scaling on CUDA; on a CPU bf16 where it is native "
                        "(AVX512-BF16, AMX), else fp32 (the plan says which and why).")
    g.add_argument("--fp16", action="store_true", help="fp16 autocast with dynamic loss scaling (DeepSpeed "
                                                       "fp16 under ZeRO).")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast, no loss scaling (DeepSpeed bf16 under ZeRO).")
    g.add_argument("--tf32", action="store_true",
                   help="Run fp32 matmuls and convolutions on TF32 tensor cores (NVIDIA Ampere or newer); no effect on "
                        "a CPU.")
    g.add_argument("--loss-scale", type=float, default=None, help="Static loss scale (fp16); default dynamic.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="Initial dynamic loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    g.add_argument("--loss-scale-window", type=int, default=1000, help="Steps without overflow before the scale grows.")
    g.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before the scale shrinks.")


def _add_compute(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("acceleration: compute", "Recomputation, graph compilation, fused optimizers")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Recompute each transformer layer in backward: torch.utils.checkpoint "
                        "(gradient_checkpointing_enable() on Hugging Face models). Megatron's "
                        "--recompute-granularity full --recompute-method uniform.")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="What is recomputed in backward (Megatron): full = whole transformer layers (only each "
                        "layer's input is kept); selective = the attention core only (scaled_dot_product_attention / "
                        "flex_attention: its inputs kept, its output recomputed); op (torchtitan's op-level selective "
                        "recompute) = each layer with the outputs of matmuls, attention kernels, collectives and "
                        "random ops kept and the rest (norms, activations, element-wise ops) recomputed.")
    g.add_argument("--recompute-modules", nargs="*", choices=tuple(RECOMPUTE_MODULE_MEANINGS), default=None,
                   help="With --recompute-granularity selective: what of each layer is recomputed (Megatron-Core's "
                        "names; default core_attn): core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, "
                        "shared_experts.")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="Which layers (with --recompute-granularity full or op): uniform = every layer, in units of "
                        "--recompute-num-layers layers (1 is served); block = only the first --recompute-num-layers "
                        "layers of each pipeline stage. Default uniform.")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="uniform: layers per recompute unit (1); block: layers recomputed per pipeline stage. "
                        "Default 1.")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's shorthand for --recompute-granularity selective.")
    g.add_argument("--cpu-offloading", action="store_true",
                   help="Keep the activations that backward needs in host memory instead of the device's, for the "
                        "first --cpu-offloading-num-layers layers of each pipeline stage: torch.autograd.graph."
                        "save_on_cpu (pinned on CUDA) copies them out in forward and back in backward "
                        "(Megatron-Core's activation offloading; not with recomputation, as there).")
    g.add_argument("--cpu-offloading-num-layers", type=int, default=0,
                   help="With --cpu-offloading: how many layers' activations go to host memory (0 to the layers - 1; "
                        "Megatron-Core's range).")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="Recompute each MoE layer (router, dispatch, experts, combine) in backward: only its input is "
                        "kept (Megatron-Core's; with --recompute-granularity selective or none beside it; a layer "
                        "recomputed whole already recomputes its MoE layer).")
    g.add_argument("--activations-checkpoint-method", choices=("uniform", "block"), default=None,
                   help="Megatron's 2021-22 name of --recompute-method; implies --recompute-granularity full.")
    g.add_argument("--activations-checkpoint-num-layers", "--checkpoint-num-layers", dest="recompute_num_layers",
                   type=int, default=None, help="Megatron's older names of --recompute-num-layers.")
    g.add_argument("--torch-compile", action="store_true",
                   help="Compile each transformer layer with torch.compile (backend and mode: --torch-compile-backend, "
                        "--torch-compile-mode).")
    g.add_argument("--torch-compile-backend", default="inductor",
                   help="torch.compile backend for --torch-compile (and --onnx-runtime-training's fallback): inductor "
                        "(generated kernels), aot_eager / eager (graph capture only, for debugging), cudagraphs, or "
                        "any backend registered with torch._dynamo.")
    g.add_argument("--torch-compile-mode", choices=COMPILE_MODES, default=None,
                   help="torch.compile mode of the inductor backend: default, reduce-overhead (CUDA graphs), "
                        "max-autotune (searches kernel configurations; slow to compile), max-autotune-no-cudagraphs. "
                        "Default: torch's default.")
    g.add_argument("--no-cpu-allocator-tuning", dest="cpu_allocator_tuning", action="store_false",
                   help="On CPU, leave glibc malloc as it is; by default freed blocks under 32 MiB stay in the heap "
                        "for the next step (as CUDA's caching allocator does) instead of being unmapped and faulted in "
                        "again.")
    g.add_argument("--onnx-runtime-training", action="store_true",
                   help="Graph optimisation: ONNX Runtime ORTModule when it imports with this torch, else "
                        "torch.compile.")
    g.add_argument("--optimizers", choices=OPTIMIZERS_RAPIDFORMER, default="apex_adam",
                   help="Fused optimizer (Rapidformer): apex FusedAdam / FusedLAMB when apex is importable, on CUDA, "
                        "and the parameters are plain tensors (one process, DDP, OSS, DeepSpeed); else torch AdamW "
                        "(fused kernel on CUDA and CPU) / rapidtrain's LAMB, as for DTensor layouts (TP, FSDP, SDP, "
                        "3D). The plan says which and why.")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="Optimizer (beyond Rapidformer), overrides --optimizers: adamw (adam is accepted for it, as "
                        "in Megatron: decoupled weight decay), adafactor (torch.optim.Adafactor, factored second "
                        "moment; --lr is relative to each parameter's RMS, capped by 1/sqrt(step), unlike Hugging "
                        "Face Trainer's Adafactor, whose --lr is the step itself: about 50x larger steps at the same "
                        "--lr for weights of RMS 0.02), sgd; the low-bit ones need bitsandbytes or torchao and are "
                        "refused, naming why, where neither serves the layout and device (`rapidtrain plan` tells "
                        "before a run); adamw_8bit: 8-bit AdamW (~2 bytes of state per parameter instead of 8), "
                        "bitsandbytes AdamW8bit for plain-tensor layouts, torchao AdamW8bit for DTensor layouts "
                        "(TP, FSDP, SDP, 3D); paged_adamw_8bit: bitsandbytes PagedAdamW8bit (CUDA, plain tensors); "
                        "adamw_4bit: torchao AdamW4bit (plain tensors); muon (Megatron-Core's dist_muon is the same "
                        "here): torch.optim.Muon for the transformer layers' 2-D weights and each MoE expert's "
                        "matrix, AdamW (--adam-beta1/2, --adam-eps, --weight-decay) for the rest (embeddings, output "
                        "head, norms, biases); under FSDP and tensor parallelism each sharded matrix is gathered whole "
                        "for its step (not with DeepSpeed ZeRO).")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    g.add_argument("--muon-momentum", type=float, default=0.9,
                   help="Muon's momentum (an exponential average of the gradients, torch.optim.Muon's).")
    g.add_argument("--muon-nesterov", action="store_true",
                   help="Nesterov momentum for Muon: orthogonalize the gradient moved toward the momentum.")
    g.add_argument("--muon-num-ns-steps", type=int, default=5,
                   help="Newton–Schulz iterations that orthogonalize each Muon update (quintic, in bfloat16).")
    g.add_argument("--muon-scale-mode", choices=MUON_SCALE_MODES, default="spectral",
                   help="Scale of a [rows, cols] weight's orthogonalized update (Megatron-Core's): spectral "
                        "sqrt(max(rows, cols)), so AdamW's rates transfer; shape_scaling sqrt(max(1, rows/cols)) "
                        "(Keller Jordan's); unit_rms_norm sqrt(rows/cols).")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                   help="Multiplies Muon's update scale (0.2 with spectral is Moonshot's match of AdamW's update RMS).")


def _add_moe(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("acceleration: mixture of experts", "Sparsely gated MoE MLPs in the built-in models")
    g.add_argument("--num-experts", type=num_experts_list, nargs="+", default=None,
                   help="Experts per MoE layer: one number (layers chosen by --moe-layer-freq) or one per "
                        "layer (0 = dense).")
    g.add_argument("--moe-layer-freq", type=moe_layer_pattern, default=1,
                   help="With one --num-experts value: every Nth layer from layer 0 is MoE (Megatron-Core's: 0, N, "
                        "2N, ...), or Megatron-Core's per-layer 0/1 pattern ('([0]*3+[1]*5)').")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Shard experts over this many data-parallel ranks; tokens move by all-to-all.")
    g.add_argument("--moe-router-topk", type=int, default=1, help="Experts per token (1 to --num-experts).")
    g.add_argument("--moe-capacity-factor", type=float, default=1.0,
                   help="Expert capacity = ceil(k × tokens / experts × factor), at least --moe-min-capacity.")
    g.add_argument("--moe-min-capacity", type=int, default=4, help="Lower bound of expert capacity.")
    g.add_argument("--disable-moe-token-dropping", action="store_true", help="Never drop tokens over capacity.")
    g.add_argument("--moe-loss-coeff", "--moe-aux-loss-coeff", dest="moe_loss_coeff", type=float, default=0.01,
                   help="Weight of the load-balancing loss (1.0 under even routing).")
    g.add_argument("--moe-z-loss-coeff", type=float, default=0.0, help="Weight of the router z-loss.")
    g.add_argument("--moe-jitter-eps", type=float, default=0.0, help="Multiplicative jitter noise on router input.")
    # Fine-grained MoE (DeepSeek-V2/V3, Qwen-MoE): Megatron-Core's router and shared experts, Pai's spellings.
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid", "sqrtsoftplus"), default="softmax",
                   help="Expert scores: softmax over the experts, or each expert's own sigmoid / sqrt(softplus) "
                        "(DeepSeek-V3), the k chosen normalised to sum 1 when k > 1.")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax over all experts and the k chosen keep their probabilities (no renormalisation "
                        "over the k; DeepSeek-V2, Qwen1.5/2-MoE).")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Multiply the routed experts' combine weights by this (DeepSeek's routed_scaling_factor).")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="Group-limited routing: the experts form this many equal groups (DeepSeek's n_group).")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Group-limited routing: each token chooses among the experts of its best this many groups "
                        "(a group scores the sum of its two best experts).")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="Benchmarking only (Megatron-Core's): route by random logits, which balances the load; the "
                        "router learns nothing.")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free load balancing: a per-expert bias added to the scores for the choice only, "
                        "moved after each step towards the mean load (saved in checkpoints).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="How far each expert bias moves per step (--moe-router-enable-expert-bias).")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Each routed expert's hidden size (default: --ffn-hidden-size, the dense layers' size).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Shared experts: a dense MLP of this hidden size (all shared experts together) beside the "
                        "routed experts of every MoE layer, which every token passes through.")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Qwen-MoE: the shared experts' output times sigmoid(Linear(hidden, 1)(x)).")
    g.add_argument("--enable-shared-expert", action="store_true",
                   help="Pai-Megatron-Patch: shared experts, sized by --shared-moe-ffn-hidden-size or "
                        "--num-shared-experts × the routed experts' size.")
    g.add_argument("--num-shared-experts", type=int, default=None,
                   help="Pai-Megatron-Patch (DeepSeek): this many shared experts of the routed experts' size "
                        "(--moe-ffn-hidden-size), one MLP of their summed size.")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="Multi-token prediction (DeepSeek-V3): this many extra depths after the layers, depth k "
                        "predicting the token k + 1 ahead through the shared embedding and head; their loss is "
                        "logged apart and added to the gradient.")
    g.add_argument("--use-multi-token-prediction", action="store_true",
                   help="Pai-Megatron-Patch's multi-token prediction switch: --mtp-num-layers from --num-mtp-predictor "
                        "(1 when not given).")
    g.add_argument("--num-mtp-predictor", type=int, default=None,
                   help="Pai-Megatron-Patch's number of multi-token prediction depths (--mtp-num-layers), with "
                        "--use-multi-token-prediction.")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="The multi-token prediction loss's weight: factor / depths × the sum of the depths' losses.")
    g.add_argument("--shared-moe-ffn-hidden-size", type=int, default=None,
                   help="Pai-Megatron-Patch (Qwen-MoE): the shared experts' hidden size, with --enable-shared-expert.")
    # Rapidformer's GPT-MoE options.
    g.add_argument("--router-type", type=router_type, default=0,
                   help="Rapidformer's router: 0 (Pai-Megatron-Patch: topk) = top-k gating with the load-balancing "
                        "loss (the built-in router).")
    g.add_argument("--moe-linear-layer-type", choices=("standard",), default="standard",
                   help="Rapidformer: the experts' linear layers (standard nn.Linear-style weights).")
    g.add_argument("--top-k-linear-strategy", choices=("normal",), default="normal",
                   help="Rapidformer: the router's gating projection (a plain linear layer).")
    g.add_argument("--mlp-type", choices=("standard", "residual"), default="standard",
                   help="residual: PR-MoE (DeepSpeed's Residual-MoE): every MoE layer adds a dense MLP, mixed with the "
                        "experts' output by a learned per-token softmax of two coefficients.")
    g.add_argument("--use-expert-residual-network", action="store_true",
                   help="Rapidformer's name for --mlp-type residual (PR-MoE).")


def _add_logging(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging", "Log lines, TensorBoard, W&B, MLflow, profiling, throughput")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between Megatron-style log lines.")
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    g.add_argument("--show-library-warnings", action="store_true",
                   help="Show every message the libraries log: by default those about optional pieces rapidtrain "
                        "does not use are hidden and a message repeated every step is shown once "
                        "(rapidtrain/core/library_warnings.py lists them).")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="Peak TFLOP/s of one device: log lines then report MFU.")
    g.add_argument("--loss-log-file", default=None,
                   help="Append every iteration's exact loss here (iteration, loss as float.hex, skipped, grad norm as "
                        "float.hex, then logged extras as name=float.hex, e.g. load_balancing_loss): for parity and "
                        "resume checks.")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="TensorBoard events buffered before they are written (SummaryWriter max_queue).")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="Write the iteration's timers (forward-backward, optimizer, data) to TensorBoard.")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true", help="Write the global batch size.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Write the validation perplexity beside the validation loss.")
    g.add_argument("--log-memory-to-tensorboard", action="store_true", help="Write the peak memory.")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true", help="Write the world size.")
    g.add_argument("--no-log-learning-rate-to-tensorboard", dest="log_learning_rate_to_tensorboard",
                   action="store_false", help="Leave the learning rate out of TensorBoard.")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard", action="store_false",
                   help="Leave the loss scale out of TensorBoard.")
    g.add_argument("--log-params-norm", action="store_true",
                   help="Show the parameters' L2 norm in the log line (and TensorBoard), as Megatron.")
    g.add_argument("--logging-path", default=None,
                   help="Rapidformer: also write what rank 0 and the logging rank print (plan, log lines, evaluations) "
                        "to this file (a folder gets rapidtrain.log inside).")
    g.add_argument("--debug", action="store_true",
                   help="Show the Python traceback of a user error (a bad flag, file or data) too; "
                        "RAPIDTRAIN_DEBUG=1 does the same.")
    g.add_argument("--wandb-project", default=None,
                   help="Log the log line's scalars and the plan (as the run's config) to this Weights & Biases "
                        "project, from the logging rank (Megatron). WANDB_MODE=offline writes the run locally with no "
                        "network (`wandb sync DIR` uploads it later).")
    g.add_argument("--wandb-exp-name", default=None,
                   help="The W&B run's name (default: one W&B makes up).")
    g.add_argument("--wandb-save-dir", default=None,
                   help="Folder for W&B's local files (default: SAVE/wandb with --save, else ./wandb).")
    g.add_argument("--mlflow-experiment", default=None,
                   help="Log the same scalars and the plan (as params and plan.json) to this MLflow experiment.")
    g.add_argument("--mlflow-tracking-uri", default=None,
                   help="Where MLflow writes: a local folder or file:DIR (MLflow's file store), sqlite:///FILE.db, or "
                        "a server's http(s) address (default: $MLFLOW_TRACKING_URI, else MLflow's sqlite:///mlflow.db "
                        "in the working folder).")
    g.add_argument("--mlflow-run-name", default=None,
                   help="The MLflow run's name (default: --wandb-exp-name when given, else one MLflow makes up).")
    g.add_argument("--profile", nargs="?", const=True, default=False, choices=(True, "pt", "pt-full"),
                   help="(Megatron's `--profile pt` / `pt-full` name the same PyTorch profiler.) Trace iterations "
                        "--profile-step-start+1 to --profile-step-end with the PyTorch profiler on "
                        "--profile-ranks (a .pt.trace.json per rank in --tensorboard-dir, else ./profile; open it "
                        "in Perfetto or TensorBoard); on CUDA also a memory snapshot (memory_snapshot_rank{R}.pickle, "
                        "for pytorch.org/memory_viz).")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="Iterations completed before tracing starts (Megatron's step index, from 0).")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="Iterations completed when tracing stops: steps [start, end) are traced.")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                   help="Global ranks that trace (default 0).")


def _add_checkpointing(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing", "Save and load (torch.distributed.checkpoint, atomic)")
    g.add_argument("--save", default=None, help="Folder where checkpoints (and the fine-tuned model) are saved.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoints.")
    g.add_argument("--load", default=None,
                   help="Folder to resume from (its latest_checkpointed_iteration.txt): rapidtrain's checkpoints, "
                        "Megatron-LM's (legacy mp_rank_* files or torch_dist) and DeepSpeed's / Megatron-DeepSpeed's "
                        "(latest → global_stepN), read into this run's layout.")
    g.add_argument("--finetune", action="store_true", help="Load the model only and start at iteration 0.")
    g.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer and scheduler state.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not load RNG states.")
    g.add_argument("--universal-checkpoint", action="store_true",
                   help="With --load, read the DeepSpeed universal checkpoint its latest_universal names (what "
                        "deepspeed.checkpoint.ds_to_universal writes) instead of the one latest names, as "
                        "Megatron-DeepSpeed does; refused when there is none. A folder with only latest_universal is "
                        "read as universal without it.")
    g.add_argument("--override-opt_param-scheduler", "--override-lr-scheduler", dest="override_opt_param_scheduler",
                   action="store_true",
                   help="On --load, keep the learning-rate schedule of these flags (only the position comes from the "
                        "checkpoint); without it a schedule that differs from the saved one is refused (Megatron).")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="On --load, take the learning-rate schedule saved in the checkpoint, whatever these flags say "
                        "(Megatron).")
    g.add_argument("--async-save", action="store_true",
                   help="Write checkpoints in the background (torch.distributed.checkpoint's async_save) while "
                        "training goes on; a checkpoint is published (latest_checkpointed_iteration.txt) once every "
                        "rank has written it: at a later iteration, the next save or the end of the run.")


GROUP_BUILDERS = (
    _add_data,
    _add_transformer,
    _add_training,
    _add_distributed,
    _add_parallelism,
    _add_memory,
    _add_precision,
    _add_compute,
    _add_moe,
    _add_logging,
    _add_checkpointing,
)


def build_parser(
    extra_args_provider: ExtraArgsProvider | None = None, prog: str = "rapidtrain"
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = FlagParser(
        prog=prog,
        description="Train transformers with Rapidformer's command line: DeepSpeed ZeRO, FSDP, OSS, tensor/pipeline/"
                    "expert parallelism, mixed precision. See `rapidtrain plan --help` for a dry run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
        # A user script's extra_args_provider may declare a flag rapidtrain knows (Rapidformer's scripts add
        # --keep-last, --train-data, --valid-data themselves): theirs replaces ours, with the same destination.
        conflict_handler="resolve",
    )
    for add_group in GROUP_BUILDERS:
        add_group(parser)
    from rapidtrain.config.flag_surface import add_surface

    add_surface(parser)  # every other Megatron-family flag (config/megatron_flags.json), classified
    # Not a flag: whether --pretrained-model-name-or-path initialises the built-in model (parse_args decides).
    parser.set_defaults(builtin_from_pretrained=False)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(
    argv: Sequence[str] | None = None,
    extra_args_provider: ExtraArgsProvider | None = None,
    defaults: dict | None = None,
    prog: str = "rapidtrain",
    entry: str | None = None,
) -> argparse.Namespace:
    """Parse flags, then apply the entry point's declared defaults (`ENTRY_DEFAULTS[entry]`, and the demo's
    when pretraining gets no --data-path) and any `defaults` a script passes, to the flags not given.

    `rapidtrain plan` resolves the same entry as the launch would, so a dry run and a run agree.
    """
    parser = build_parser(extra_args_provider, prog=prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    given = given_flags(parser, argv)
    chosen = entry_defaults(entry, args, given)
    chosen.update(defaults or {})
    for dest, value in _defaults_not_overridden(chosen, given).items():
        setattr(args, dest, value)
    args.builtin_from_pretrained = builtin_from_pretrained(args)
    if args.builtin_from_pretrained:  # shape flags not given come from the Hugging Face folder's config.json
        from rapidtrain.models.hf_config import apply_pretrained_defaults

        apply_pretrained_defaults(args, given)
    if args.dataset_name and not args.data_name:
        args.data_name = args.dataset_name
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    from rapidtrain.config.meanings import apply_megatron_meanings
    from rapidtrain.config.surface_meanings import apply_surface

    surface_notes = apply_surface(args, parser, given)  # the other Megatron-family flags: applied, noted or refused
    apply_megatron_meanings(args, given, entry, surface_notes)  # Megatron's leniencies, Rapidformer's meanings
    args.given_flags = sorted(given)  # which flags the user typed (the plan tells them from defaults)
    return args


def is_megatron_task(args: argparse.Namespace) -> bool:
    """--task MNLI / RACE: Megatron's tasks/main.py, whose --train-data/--valid-data are task files (not indexed
    data) and whose --pretrained-checkpoint is the BERT the task's model starts from (not --load)."""
    return args.task in MEGATRON_TASKS


def builtin_from_pretrained(args: argparse.Namespace) -> bool:
    """--task pretraining with --pretrained-model-name-or-path, and no --user-script (whose script decides what
    the folder is for): the folder initialises the built-in model, its config.json giving the shape flags not
    written. The fine-tuning tasks load the folder as a Hugging Face model instead."""
    from rapidtrain.models.hf_config import is_megatron_checkpoint

    return args.task == "pretraining" and bool(args.pretrained_model_name_or_path) and not args.user_script \
        and not is_megatron_checkpoint(args)


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the flags present in `argv` (parsed again with every default suppressed)."""
    saved = [(action, action.default) for action in parser._actions]
    parser_defaults = dict(parser._defaults)  # an entry point's set_defaults, which parsing would fill in
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        namespace, _ = parser.parse_known_args(argv)
        vars(namespace).pop("megatron_flags_given", None)  # the record of flags given, not a flag
    finally:
        for action, default in saved:
            action.default = default
        parser._defaults.update(parser_defaults)
    return set(vars(namespace))


# Entry points' own defaults, declared once. Megatron's pretrain_gpt.py / pretrain_bert.py default the
# tokenizer of real data; the demo's small-model settings apply only when pretraining names no data.
MEGATRON_TOKENIZERS = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}
ENTRY_DEFAULTS: dict[str, dict] = {
    "pretrain": {},  # rapidtrain/pretrain.py and `rapidtrain --task pretraining`: GPT unless --model-type bert
    "pretrain_gpt": {"model_type": "gpt"},
    "pretrain_bert": {"model_type": "bert"},
    "tasks_main": {"model_type": "bert"},  # Megatron's tasks/main.py: the built-in BERT fine-tuned on --task MNLI/RACE
}
# The demo learns visibly in about five minutes on 2 CPU cores (docs/first-hour.md): a narrow model (hidden
# 128, 128-token samples) sees more tokens in that time than a wide one learns from, at a learning rate a model this
# small takes, with Adam's second moment following the short run (beta2 0.99).
DEMO_DEFAULTS = {"train_iters": 2000, "hidden_size": 128, "seq_length": 128, "lr": 5e-3, "min_lr": 5e-4,
                 "lr_decay_style": "cosine", "lr_warmup_fraction": 0.03, "adam_beta2": 0.99, "micro_batch_size": 16,
                 "log_interval": 50, "eval_interval": 200, "eval_iters": 10, "hidden_dropout": 0.0,
                 "attention_dropout": 0.0}


def uses_demo_data(args: argparse.Namespace) -> bool:
    """Built-in pretraining with no --data-path (nor per-split data) trains on the demo corpus; a Hugging Face
    folder needs data in its own tokenizer."""
    from rapidtrain.models.hf_config import is_megatron_checkpoint

    per_split = any(getattr(args, name, None) for name in ("train_data_path", "train_data",
                                                           "train_weighted_split_paths",
                                                           "train_weighted_split_paths_path"))
    pretrained = args.pretrained_model_name_or_path and not is_megatron_checkpoint(args)
    return not args.data_path and not per_split and not pretrained


def entry_defaults(entry: str | None, args: argparse.Namespace, given: set[str]) -> dict:
    if entry is None:
        return {}
    if entry not in ENTRY_DEFAULTS:
        raise ValueError(f"unknown entry point {entry!r}; one of {', '.join(ENTRY_DEFAULTS)}")
    chosen = dict(ENTRY_DEFAULTS[entry])
    if uses_demo_data(args):
        chosen.update(DEMO_DEFAULTS)
        if "lr" in given and "min_lr" not in given and args.lr and args.lr > 0:  # the demo's floor stays under --lr
            chosen["min_lr"] = min(DEMO_DEFAULTS["min_lr"], args.lr / 10)
    else:
        model_type = args.model_type if "model_type" in given else chosen.get("model_type", args.model_type)
        chosen["tokenizer_type"] = MEGATRON_TOKENIZERS[model_type]
    return chosen


# Flags that say the same thing two ways: a user who gives one overrides an entry point's default for the other.
ALTERNATIVE_FLAGS = (("lr_warmup_iters", "lr_warmup_fraction"), ("lr_warmup_samples", "lr_warmup_fraction"),
                     ("train_iters", "train_samples"))


def _defaults_not_overridden(defaults: dict, given: set[str]) -> dict:
    kept = {dest: value for dest, value in defaults.items() if dest not in given}
    for pair in ALTERNATIVE_FLAGS:
        for dest, other in (pair, pair[::-1]):
            if other in given:
                kept.pop(dest, None)
    return kept


def flag_values(args: argparse.Namespace) -> dict:
    """The flags as plain JSON values (for checkpoints and the run's config)."""
    return {key: value for key, value in vars(args).items() if key != "given_flags"}


def flag_table(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, str, str]]:
    """(group, flags, default) of every visible flag: what the snapshot test and the docs read."""
    parser = parser or build_parser()
    rows = []
    for group in parser._action_groups:  # argparse exposes groups only this way
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or not action.option_strings or action.dest == "help":
                continue
            rows.append((group.title or "", " ".join(action.option_strings), repr(action.default)))
    return rows
