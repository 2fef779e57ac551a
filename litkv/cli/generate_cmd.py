"""`litkv generate`: sample from a checkpoint through a KV cache policy, streaming the text."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from litkv.checkpoints.checkpoint import check_checkpoint_dir, load_tokenizer
from litkv.checkpoints.runtime import load_for_inference
from litkv.cli.answers import check_output, print_answers, shorten_echo
from litkv.cli.common import resolve_checkpoint_dir
from litkv.core.validation import read_text_file, require_int
from litkv.inference.blocks import Segment, prompt_segments
from litkv.inference.chat_prompt import encode_prompt
from litkv.inference.chat_template import Format, RawFormat, TemplateFormat, load_format
from litkv.inference.generate import generate as generate_tokens
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.inference.sampling import Sampling
from litkv.inference.text_stream import TextStream
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.kvzip import KVzipKVCache
from litkv.states.block_store import BlockStore
from litkv.states.prefix import PrefixCache

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = ["DEFAULT_PROMPT", "fit_cache", "fit_kvzip", "generate"]

#: This command, read by litkv/__main__.py from the source (never imported for it): `CommandSpec`.
COMMAND = {
    "name": "generate",
    "function": "generate",
    "checkpoint_positional": True,
    "flags": ["--compile"],
    "repeated": ["--prompt", "--block_file"],
}

DEFAULT_PROMPT = "And it came to pass, when"
_DEFAULT_KV_CACHE = KVCacheConfig()  # never mutated; a dataclass default lets --help list its fields
DEFAULT_CACHE_LENGTH = _DEFAULT_KV_CACHE.cache_length
#: Enough for an instruct model's answer to end at its end-of-turn token rather than mid-sentence.
DEFAULT_MAX_NEW_TOKENS = 512
PROMPT_CACHE_BYTES = 1 << 30  # bound of the --prompt_cache store, in memory and on disk


def generate(
    checkpoint_dir: Path | None = None,
    prompt: list[str] | None = None,
    prompt_file: Path | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    kv_cache: KVCacheConfig = _DEFAULT_KV_CACHE,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 1234,
    precision: str | None = None,
    device: str | None = None,
    num_threads: int | None = None,
    prompt_cache: Path | None = None,
    compile: bool = False,
    chat_template: bool | None = None,
    block_file: list[Path] | None = None,
    recompute: float = 0.0,
    quantize: str = "none",
    output: str = "text",
) -> list[torch.Tensor]:
    """Generate text from a checkpoint, with a KV cache policy.

    Only the answer goes to stdout (`litkv generate ... > answer.txt` holds the answer alone); the prompt
    (a long one shortened), the progress bar and a summary line (tokens, speed, cache bytes) go to stderr.
    With one prompt the answer is streamed as it is produced; several prompts run as one batch, each
    answer printed at the end on one line, its newlines written as ``\\n`` and backslashes as ``\\\\`` (its
    prompt under a `--- prompt i ---` header on stderr). ``--output jsonl`` prints one JSON object per
    prompt and line instead: index, text, prompt_tokens, new_tokens, finish_reason ("stop" or "length").
    In Python, `litkv.chat_prompt(tokenizer, text)` gives the ids this command feeds for a prompt.

    Args:
        checkpoint_dir: LitGPT-layout directory (model_config.yaml, model.safetensors or
            lit_model.pth, tokenizer files). Default: the model shipped with litkv.
        prompt: Prompt text; repeat ``--prompt`` for several prompts (one batch).
        prompt_file: A file whose whole content is one prompt (instead of --prompt).
        max_new_tokens: Most tokens to generate per prompt (an answer ends sooner at EOS or the chat
            template's end-of-turn token).
        kv_cache: KV cache policy and budget. ``--kv_cache NAME`` (or ``--kv-cache NAME``) is short
            for ``--kv_cache.policy NAME``. A dense cache whose cache_length is left at its default is
            sized to hold the prompt plus the new tokens.
        temperature: Sampling temperature; 0 for greedy decoding.
        top_k: Sample among the k most likely tokens only.
        top_p: Nucleus sampling threshold in (0, 1].
        seed: Random seed of the sampler.
        precision: "32-true", "bf16-true", "16-true" or "64-true". Default: bf16 on CUDA, else 32.
        device: "cpu", "cuda", "cuda:1", ... Default: CUDA if available.
        num_threads: CPU threads for torch. Default: torch's choice (one per core).
        prompt_cache: A directory where the cache states of prompt prefixes are kept across runs (1 GiB
            at most, least recently used dropped): a prompt that starts like an earlier one restores the
            state after their common blocks of chunk_size tokens instead of computing it again.
        compile: Run the decode steps through torch.compile (static shapes; the first call compiles,
            a minute or more for a 30-layer model on a CPU; worth it for long generations on a GPU; on a
            CPU a float32 model's eager steps are about as fast: docs/cpu_speed.md).
        chat_template: Send each prompt as a user message in the checkpoint's chat template (with the
            generation prompt; the reply ends at the template's end-of-turn token or EOS): true, false
            (raw text: base models, the shipped model), or unset: when the checkpoint has one.
        block_file: Files whose texts come before the prompt as KV blocks (repeat for several): each is
            tokenized alone, its cache computed alone once (kept in memory, and under
            ``--prompt_cache``/blocks across runs) and spliced at its offset (docs/blocks.md); several
            prompts are each put after the blocks and decoded as one batch.
        recompute: With ``--block_file``: the fraction of each spliced block's tokens recomputed with
            their context (0: pure splice; 1: a normal prefill).
        quantize: Weight-only quantisation of the linear layers at load (CPU only): "none", "int8"
            (per output channel), "int4" (groups of 32 input columns) or "int4-gN" (N = 64, 128, 256).
        output: "text" (an answer streamed; a batch's answers one escaped line each) or "jsonl" (one JSON
            object per prompt: index, text, prompt_tokens, new_tokens, finish_reason).

    Returns:
        The new tokens of each prompt.
    """
    sampling = Sampling(temperature, top_k, top_p, seed=seed)  # refused before the model loads
    require_int("max_new_tokens", max_new_tokens, 0)
    check_output(output)
    ckpt = check_checkpoint_dir(resolve_checkpoint_dir(checkpoint_dir))
    texts = _read_prompts(prompt, prompt_file)
    model, dev = load_for_inference(ckpt, precision, device, num_threads, quantize)
    tokenizer = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tokenizer, chat_template)
    prompts, lengths = _prompts(fmt, tokenizer, texts, block_file, dev)
    kv_cache = fit_cache(kv_cache, max(lengths), max_new_tokens)
    repeat = None  # kvzip's reconstruction prompt, in the format the prompts are in
    if issubclass(kv_cache.policy_class, KVzipKVCache):
        kv_cache = fit_kvzip(kv_cache, max(lengths), max_new_tokens)
        repeat = RepeatPrompt.build(tokenizer, fmt.template if isinstance(fmt, TemplateFormat) else None)
    if max(lengths) + max_new_tokens > model.config.block_size:
        print(
            f"warning: prompt + new tokens ({max(lengths) + max_new_tokens}) exceed the model's context length "
            f"({model.config.block_size}); quality may degrade",
            file=sys.stderr,
        )
    stop = tuple(sorted(fmt.stop_ids))
    stream = _Stream(tokenizer, model, echo=len(texts) == 1 and output == "text", stop=stop)
    if stream.echo:
        _echo_prompt(shorten_echo(texts[0], lengths[0]), fmt)
    prefix_cache = block_store = None
    if block_file:
        block_store = BlockStore(PROMPT_CACHE_BYTES, None if prompt_cache is None else Path(prompt_cache) / "blocks")
    elif prompt_cache is not None:
        prefix_cache = PrefixCache(PROMPT_CACHE_BYTES, prompt_cache)
    stream.start()
    outputs = generate_tokens(
        model,
        prompts,
        max_new_tokens,
        kv_cache,
        dataclasses.replace(sampling, stop_tokens=stop),
        on_tokens=stream,
        progress=True,
        prefix_cache=prefix_cache,
        block_store=block_store,
        recompute=recompute,
        compile=compile,
        kvzip_repeat=repeat,
    )
    if stream.echo:
        stream.finish()
    else:
        print_answers(texts, outputs, lengths, tokenizer, stop, output)
    new_tokens = sum(out.numel() for out in outputs)
    print(stream.summary(len(prompts), sum(lengths), new_tokens, kv_cache, compile), file=sys.stderr)
    if prefix_cache is not None:
        print(f"prompt cache: {prefix_cache.reused_tokens} of {sum(lengths)} prompt tokens reused", file=sys.stderr)
    if block_store is not None:
        restored = block_store.reused_tokens
        print(f"blocks: {len(block_file)}, {restored} block tokens restored, recompute={recompute}", file=sys.stderr)
    return outputs


def fit_cache(kv_cache: KVCacheConfig, prompt_tokens: int, max_new_tokens: int) -> KVCacheConfig:
    """`kv_cache`, with a bounded (dense) cache left at the default `cache_length` sized to hold the longest
    prompt (`prompt_tokens`) plus the new tokens (grown or shrunk; at least its chunk sizes); a bounded
    cache the user sized too small is a ValueError naming `--kv_cache.cache_length` and the value that fits.

    An explicit `--kv_cache.cache_length 1024` (the default's value) cannot be told from the default and
    is sized too. Evicting policies are returned as they are: their size is the user's budget.
    """
    needed = prompt_tokens + max(max_new_tokens - 1, 0)  # the last new token is never stored
    limit = kv_cache.policy_class.max_tokens(kv_cache)
    if limit is None:
        return kv_cache
    if kv_cache.cache_length == DEFAULT_CACHE_LENGTH and needed != limit:
        chunks = [n for n in (kv_cache.chunk_size, kv_cache.prefill_length) if n is not None]
        return dataclasses.replace(kv_cache, cache_length=max(needed, *chunks, 1))
    if needed <= limit:
        return kv_cache
    raise ValueError(
        f"--kv_cache.cache_length {kv_cache.cache_length} is too small for a {kv_cache.policy} cache: the prompt "
        f"({prompt_tokens} tokens) and --max_new_tokens {max_new_tokens} need --kv_cache.cache_length {needed} "
        "(or leave it unset), or a policy that evicts, e.g. --kv-cache h2o"
    )


def fit_kvzip(kv_cache: KVCacheConfig, prompt_tokens: int, max_new_tokens: int) -> KVCacheConfig:
    """A `kvzip` config for a run: `cache_length` is what the compression keeps (its `budget`, unless the
    options give one), and the cache grows to hold the whole prompt plus the new tokens until it is
    compressed (KVzip reconstructs the whole prompt from the cache, then evicts)."""
    options = dict(kv_cache.options or {})
    options.setdefault("budget", kv_cache.cache_length)
    needed = prompt_tokens + max(max_new_tokens - 1, 0)
    return dataclasses.replace(kv_cache, cache_length=max(kv_cache.cache_length, needed), options=options)


def _prompts(
    fmt: Format, tokenizer: Tokenizer, texts: list[str], block_file: list[Path] | None, device: torch.device
) -> tuple[list[torch.Tensor] | list[list[Segment]], list[int]]:
    """Each prompt as token ids `(T,)`, or with `--block_file` as segments (the blocks, then the prompt in one
    user message: `prompt_segments`); and their lengths. ValueError for a prompt of no tokens."""
    if block_file:
        blocks = [read_text_file("block file", path) for path in block_file]
        segmented = [prompt_segments(fmt, tokenizer, blocks, text) for text in texts]
        return segmented, [sum(int(s.ids.numel()) for s in segments) for segments in segmented]
    encoded = [_encode(fmt, tokenizer, text, device) for text in texts]
    for i, ids in enumerate(encoded):
        if ids.numel() == 0:
            raise ValueError(f"prompt {i} encodes to no tokens: give a non-empty prompt")
    return encoded, [ids.numel() for ids in encoded]


def _echo_prompt(text: str, fmt: Format) -> None:
    """The prompt, on stderr (stdout holds the answer alone, so that it pipes). Raw text is continued on
    the same line where stdout and stderr are both a terminal (the answer reads on from the prompt);
    elsewhere, and before a chat reply, the echo ends its line."""
    on_one_screen = sys.stdout.isatty() and sys.stderr.isatty()
    same_line = isinstance(fmt, RawFormat) and (on_one_screen or text.endswith("\n"))
    print(text, end="" if same_line else "\n", file=sys.stderr, flush=True)


def _encode(fmt: Format, tokenizer: Tokenizer, text: str, device: torch.device) -> torch.Tensor:
    """A prompt's ids `(T,)`: raw text (BOS per the tokenizer), or one user message in the chat template
    (`litkv.chat_prompt` gives the same ids in Python)."""
    return encode_prompt(fmt, tokenizer, text, device)


def _read_prompts(prompt: list[str] | None, prompt_file: Path | None) -> list[str]:
    """The prompts of the batch: `--prompt` values, or the content of `--prompt_file`, or the default."""
    if prompt is not None and prompt_file is not None:
        raise ValueError("give --prompt or --prompt_file, not both")
    if prompt_file is not None:
        return [read_text_file("prompt file", prompt_file)]
    if prompt is None:
        return [DEFAULT_PROMPT]
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("--prompt was given an empty list; give at least one prompt")
    return list(prompt)


class _Stream:
    """`on_tokens` callback: prints the new text of a single prompt (`TextStream`, up to and including a stop
    token), times prefill and decode."""

    def __init__(self, tokenizer: Tokenizer, model: torch.nn.Module, echo: bool, stop: tuple[int, ...] = ()) -> None:
        self.stop = stop
        self.model = model
        self.echo = echo
        self.text = TextStream(tokenizer)
        self.steps = 0
        self.cache_bytes = 0
        self.t_start = self.t_first = self.t_second = self.t_last = 0.0

    def start(self) -> None:
        self.t_start = time.perf_counter()

    def __call__(self, tokens: torch.Tensor) -> None:
        """`tokens`: `(B,)` the step's new tokens."""
        values = tokens.tolist()  # also synchronises the device, for the timings
        now = time.perf_counter()
        if self.steps == 0:
            self.t_first = now
            self.cache_bytes = sum(cache.nbytes() for cache in self.model.kv_caches if cache is not None)
        elif self.steps == 1:
            self.t_second = now
        self.t_last = now
        self.steps += 1
        if not self.echo:
            return
        if self.text.ids and self.text.ids[-1] in self.stop:
            return
        print(self.text.add(values[0]), end="", flush=True)

    def finish(self) -> None:
        """Print what is left (an incomplete character included) and end the line."""
        print(self.text.finish(), flush=True)

    def summary(
        self, batch_size: int, prompt_tokens: int, new_tokens: int, kv_cache: KVCacheConfig, compiled: bool = False
    ) -> str:
        """One line: prompt and new tokens, prefill and decode speed (all rows), cache bytes.

        A speed is computed only from a measured, non-zero duration, else it reads ``n/a``: with no new
        token no prefill ran (and no cache was built), with one new token there was no decode step.
        When compiled, the first decode step (which compiles) is reported apart from the speed.
        """
        prefill_s = self.t_first - self.t_start
        prefill = f"{prompt_tokens / prefill_s:.1f} tok/s" if self.steps > 0 and prefill_s > 0 else "n/a"
        first, steps = (self.t_second, self.steps - 2) if compiled else (self.t_first, self.steps - 1)
        decode_s = self.t_last - first
        decode = f"{batch_size * steps / decode_s:.1f} tok/s" if steps > 0 and decode_s > 0 else "n/a"
        if compiled and self.steps > 1:
            decode += f" (first step, compiling: {self.t_second - self.t_first:.1f} s)"
        cache = f"{self.cache_bytes / 2**20:.2f} MiB" if self.steps > 0 else "not built"
        return (
            f"prompt tokens: {prompt_tokens} | new tokens: {new_tokens} | prefill: {prefill} | decode: {decode} | "
            f"cache: {kv_cache.policy}, {kv_cache.cache_length} slots, {cache}"
        )
