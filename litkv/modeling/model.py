"""GPT with a pluggable per-layer KV cache. `state_dict` keys are identical to `litgpt.GPT`'s.

LitGPT's configs, MLP and norm classes and RoPE tables are reused; the attention (`self_attention.py`), the
masks (built from token positions for the call at hand, never a `block_size^2` buffer) and the forward are ours.
Here: the input checks, the GPT (caches attached, RoPE tables, the forward, compiled decode steps) and its
`Block` (an attention layer or a recurrent mixer, then the MLP).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch._dynamo
import torch.nn as nn
from litgpt.model import GPT as LitGPT

from litkv.core.validation import require_int
from litkv.gates.gate import EvictionGates
from litkv.kvcache.base import LayerCache
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.config import KVCacheConfig
from litkv.kvcache.machine import SlotMachine
from litkv.kvcache.recurrent import RecurrentCache, check_recurrent_entries
from litkv.modeling.config import RECURRENT_KINDS, Config, layer_kinds
from litkv.modeling.fused_decode import mlp_step, qkv_step
from litkv.modeling.gated_deltanet import GatedDeltaNet
from litkv.modeling.mamba2 import Mamba2Mixer
from litkv.modeling.memory import cache_bytes, check_cache_memory
from litkv.modeling.self_attention import CausalSelfAttention

__all__ = ["GPT", "MIXERS", "Block", "BlockHook", "Mixer", "check_integer_tensor", "kv_cache_configs"]

Mixer = type[CausalSelfAttention] | type[Mamba2Mixer] | type[GatedDeltaNet]
#: A layer kind -> its mixer (`Block.attn`): the module, `new_cache` (the cache its state lives in, sized by
#: its `state_shape`) and `reads_rope` (how a block calls it).
MIXERS: dict[str, Mixer] = {mixer.kind: mixer for mixer in (CausalSelfAttention, Mamba2Mixer, GatedDeltaNet)}

# Called with (block index, block input `(B, T, n_embd)`); a returned tensor replaces the input.
BlockHook = Callable[[int, torch.Tensor], "torch.Tensor | None"]
# A decode step: `(tokens (B, T), positions (B, T)) -> (B, V)` last logits.
DecodeStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_integer_tensor(name: str, value: object, what: str = "token ids") -> None:
    """Raise TypeError unless `value` is a tensor of an integer dtype (bool, float, complex refused).

    Token ids and positions are never cast from a float or bool tensor: that would silently truncate.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an integer (int64) tensor of {what}, got {type(value).__name__}")
    dtype = value.dtype
    if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise TypeError(
            f"{name} must be an integer (int64) tensor of {what}, got dtype {dtype}: float and bool "
            "tensors are not converted silently"
        )


def kv_cache_configs(kv_cache: object) -> list[KVCacheConfig] | None:
    """Check a `kv_cache` argument: a `KVCacheConfig` (returns `None`) or a non-empty list/tuple of them.

    Raises TypeError naming the type given (e.g. a dict or a policy name string).
    """
    if isinstance(kv_cache, KVCacheConfig):
        return None
    if not isinstance(kv_cache, (list, tuple)) or not kv_cache:
        hint = " (build one: KVCacheConfig(policy=...))" if isinstance(kv_cache, (str, dict)) else ""
        raise TypeError(
            "kv_cache must be a KVCacheConfig or a non-empty list of them (one per layer), "
            f"got {type(kv_cache).__name__} {kv_cache!r:.80}{hint}"
        )
    for i, cfg in enumerate(kv_cache):
        if not isinstance(cfg, KVCacheConfig):
            raise TypeError(
                f"kv_cache must be a KVCacheConfig or a list of them (one per layer), "
                f"but kv_cache[{i}] is {type(cfg).__name__} {cfg!r:.80}"
            )
    return list(kv_cache)


class GPT(nn.Module):
    """Decoder-only transformer for any `litgpt.Config` preset (except latent attention)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        if config.padded_vocab_size is None:
            raise ValueError("config.padded_vocab_size must be set")
        if config.latent_attention:
            raise NotImplementedError("multi-head latent attention (DeepSeek-V3 configs) is not supported")
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=config.norm_class(config.n_embd, eps=config.norm_eps),
            )
        )
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        # The attached caches (the run's cache state lives there, `last_pos` included); `None`: none.
        self.caches: KVCaches | None = None
        # Trained eviction gates (`litkv.gates`), read by the `learned` policy; `None`: none loaded.
        self.eviction_gates: EvictionGates | None = None
        # False inside `trusted_inputs()`: the checks that read tensors on the host are skipped.
        self._checks = True
        # Inside `trusted_inputs(no_pads=True)`: the calls hold no pad position.
        self._trusted_no_pads = False
        # (backend, mode, the compiled step)
        self._compiled_decode: tuple[str, str | None, DecodeStep] | None = None

    @classmethod
    def from_name(cls, name: str) -> GPT:
        """Build from a LitGPT preset name, e.g. ``"pythia-14m"``."""
        return cls(Config.from_name(name))

    # -- KV caches ------------------------------------------------------------------------------

    def build_kv_caches(
        self,
        kv_cache: KVCacheConfig | Sequence[KVCacheConfig],
        batch_size: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> list[LayerCache | RecurrentCache]:
        """One fresh cache per layer (a single config for all layers, or one config per layer).

        A recurrent (Mamba-2, Gated DeltaNet) layer of a hybrid model gets a `RecurrentCache`: policies cover
        the attention layers only (`KVCaches.coverage` says which). In a per-layer list, a recurrent layer's
        entry is a placeholder that must be the config of some attention layer; one that names a policy for it
        alone is a ValueError.

        The caches take `dtype`, else the autocast dtype when autocast is on, else the model's dtype.
        """
        per_layer = kv_cache_configs(kv_cache)
        configs = [kv_cache] * self.config.n_layer if per_layer is None else per_layer
        require_int("batch_size", batch_size, 1)
        if len(configs) != self.config.n_layer:
            raise ValueError(f"expected one KVCacheConfig per layer ({self.config.n_layer}), got {len(configs)}")
        ref = self.lm_head.weight
        device = ref.device if device is None else device
        if dtype is None:
            autocast = torch.is_autocast_enabled(ref.device.type)
            dtype = torch.get_autocast_dtype(ref.device.type) if autocast else ref.dtype
        kinds = layer_kinds(self.config)
        if per_layer is not None:
            check_recurrent_entries(per_layer, [kind in RECURRENT_KINDS for kind in kinds])
        _check_memory(self.config, configs, kinds, batch_size, device, dtype)
        c = self.config
        return [
            MIXERS[kind].new_cache(c, cfg, batch_size, device, dtype)  # type: ignore[arg-type]
            for cfg, kind in zip(configs, kinds, strict=True)
        ]

    def set_kv_caches(self, caches: KVCaches | Sequence[LayerCache] | None) -> KVCaches | None:
        """Attach the caches of a run (a `KVCaches`, or one layer cache per layer; `None`: detach all).

        Returns:
            The attached `KVCaches` (a list is wrapped in a fresh one: position checks restart).
        """
        if caches is not None and not isinstance(caches, KVCaches):
            caches = KVCaches(caches)
        if caches is not None and len(caches) != self.config.n_layer:
            raise ValueError(f"expected {self.config.n_layer} caches (one per layer), got {len(caches)}")
        for i, block in enumerate(self.transformer.h):
            block.attn.kv_cache = None if caches is None else caches[i]
            cache = block.attn.kv_cache
            if isinstance(cache, SlotMachine) and cache.needs_rope:  # policies scoring with RoPE (expected-attention)
                column = None if self.config.rope_indices is None else self.config.rope_indices[i]
                cache.policy.bind_rope(self._rope_table, self.config.rope_n_elem, column)
            if isinstance(cache, SlotMachine) and cache.needs_gates:  # the `learned` policy
                cache.policy.bind_gates(self.eviction_gates, i)
        self.caches = caches
        return caches

    @property
    def last_pos(self) -> torch.Tensor | None:
        """`(B,)` int64 largest position each row has seen through the attached caches (`KVCaches.last_pos`)."""
        return None if self.caches is None else self.caches.last_pos

    @last_pos.setter
    def last_pos(self, value: torch.Tensor | None) -> None:
        if self.caches is None:
            raise ValueError("no KV caches are attached: call set_kv_caches() first")
        self.caches.last_pos = value

    @contextmanager
    def kv_caches_attached(
        self,
        kv_cache: KVCacheConfig | Sequence[KVCacheConfig] | Sequence[LayerCache] | KVCaches,
        batch_size: int | None = None,
    ) -> Iterator[KVCaches]:
        """Attach caches for the duration of a `with` block, and detach them however it ends.

        Args:
            kv_cache: a config for all layers, one config per layer (fresh caches for `batch_size` rows
                are built), one ready cache per layer, or a `KVCaches`.
            batch_size: rows of the fresh caches (needed with configs).

        Yields:
            The attached `KVCaches` (a sequence of the layer caches).
        """
        if isinstance(kv_cache, KVCaches):
            caches = kv_cache
        elif isinstance(kv_cache, (list, tuple)) and kv_cache and not isinstance(kv_cache[0], KVCacheConfig):
            caches = list(kv_cache)
        else:
            if batch_size is None:
                raise ValueError("batch_size is needed to build caches from KVCacheConfig")
            caches = self.build_kv_caches(kv_cache, batch_size)
        attached = self.set_kv_caches(caches)
        try:
            yield attached
        finally:
            self.set_kv_caches(None)

    @contextmanager
    def trusted_inputs(self, max_position: int, no_pads: bool = False) -> Iterator[None]:
        """Skip the checks that read tensors on the host (token ids in the vocabulary, positions
        increasing, RoPE table long enough) for calls made inside the block.

        For callers whose inputs are valid by construction (`generate`'s decode loop: sampled tokens,
        positions one past the last); a decode step then never waits for the device, and `torch.compile`
        sees no graph break. The RoPE table is built for `max_position` first. `no_pads`: the caller's calls
        hold no `-1` position (attention may then use a compressed cache's layout without reading them).
        """
        self._rope_table(max_position + 1)
        previous = self._checks, self._trusted_no_pads
        self._checks, self._trusted_no_pads = False, no_pads
        try:
            yield
        finally:
            self._checks, self._trusted_no_pads = previous

    @property
    def kv_caches(self) -> list[SlotMachine | None]:
        """The attached layer caches (`None` per layer when none are attached)."""
        return [block.attn.kv_cache for block in self.transformer.h]

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        idx: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        *,
        lm_head: bool = True,
        block_hook: BlockHook | None = None,
    ) -> torch.Tensor:
        """Run the model.

        Args:
            idx: `(B, T)` token ids.
            input_pos: `None` for the plain training forward (positions `0..T-1`, no cache), or `(B, T)`
                int64 token positions (`-1` for padding) to run through the attached KV caches.
            lm_head: if False, return the final hidden states (after the final norm).
            block_hook: called at the start of every block with `(block_idx, x)`; may return a
                replacement for `x`.

        Returns:
            `(B, T, padded_vocab_size)` logits, or `(B, T, n_embd)` hidden states.
        """
        idx = self._check_idx(idx)
        t = idx.shape[1]
        if input_pos is None:
            positions = torch.arange(t, device=idx.device)[None]
        else:
            input_pos = self._check_positions(idx, input_pos)
            positions = input_pos
        cos, sin = self.rope(positions)
        x = self.transformer.wte(idx)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        rope_indices = self.config.rope_indices
        # a multi-token call without pads may use SDPA's causal kernel where a layer's cache held nothing
        # before (one host read, outside trusted decode steps)
        if self._checks:
            no_pads = input_pos is not None and t > 1 and bool((input_pos >= 0).all())
        else:  # trusted steps: known by the caller (`trusted_inputs`), no host read
            no_pads = input_pos is not None and self._trusted_no_pads
        caches = self.caches if input_pos is not None else None
        # a decode step: each layer attends, then every layer evicts at once after the loop
        evict_later = caches is not None and caches.begin_call(t)
        for i, block in enumerate(self.transformer.h):
            if block_hook is not None:
                replaced = block_hook(i, x)
                x = x if replaced is None else replaced
            c, s = (cos, sin) if rope_indices is None else (cos[..., rope_indices[i]], sin[..., rope_indices[i]])
            x = block(x, c, s, input_pos, no_pads, evict_later)
        if caches is not None and evict_later:
            caches.evict_waiting()
        x = self.transformer.ln_f(x)
        return self.logits(x) if lm_head else x

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One call through the attached caches: `(B, T)` tokens and positions -> `(B, V)` last logits."""
        return self(tokens, positions)[:, -1]

    def compiled_decode_step(self, backend: str | None = None, mode: str | None = None) -> DecodeStep:
        """`decode_step` through `torch.compile` (static shapes, `fullgraph=True`), built once per model and reused.

        Dynamo compiles again only when what the step depends on changes (another cache policy or
        shape); over the steps of one `generate` it does not. `backend`: a `torch.compile` backend
        (default: the one built before, else `"inductor"`); `mode`: a `torch.compile` mode (default: the
        one built before, else `"reduce-overhead"` for inductor on CUDA, the whole step one CUDA graph,
        and inductor's default elsewhere). Naming another backend or mode rebuilds the step.
        """
        built = self._compiled_decode
        if built is None or (backend is not None and backend != built[0]) or (mode is not None and mode != built[1]):
            name = backend or "inductor"
            if mode is None and name == "inductor" and self.lm_head.weight.device.type == "cuda":
                mode = "reduce-overhead"
            step = torch.compile(self.decode_step, backend=name, mode=mode, dynamic=False, fullgraph=True)
            self._compiled_decode = (name, mode, step)
        return self._compiled_decode[2]

    def mark_static_addresses(self) -> None:
        """The RoPE table and the attached caches' tensors keep their addresses across compiled decode steps
        (`KVCaches.mark_static_addresses`): a CUDA graph reads them in place, no copy per replay."""
        for t in self._rope or ():
            torch._dynamo.mark_static_address(t, guard=False)
        if self.caches is not None:
            self.caches.mark_static_addresses()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head (and final soft-capping): `(B, T, n_embd)` -> `(B, T, padded_vocab_size)`."""
        out = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return out if cap is None else torch.tanh(out / cap) * cap

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `(B, T)` positions (`-1` treated as 0): `(B, T, rope_n_elem[, 2])` each."""
        if self._checks:
            cos, sin = self._rope_table(int(positions.max()) + 1 if positions.numel() else 1)
        elif self._rope is None:
            raise RuntimeError("trusted_inputs() builds the RoPE table; it was not built")
        else:
            cos, sin = self._rope
        index = positions.clamp(min=0)
        return cos[index], sin[index]

    def rope_table_bytes(self, needed: int) -> int:
        """Bytes of the cos/sin tables `_rope_table(needed)` builds (float32, a power of two of positions)."""
        return 2 * 4 * self._rope_length(needed) * self.config.rope_n_elem

    def _rope_length(self, needed: int) -> int:
        length = max(needed, min(self.config.block_size, 4096))
        return 1 << (length - 1).bit_length()

    def _rope_table(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables for at least `needed` positions (rebuilt when shorter or on another device)."""
        ref = self.lm_head.weight
        if self._rope is None or self._rope[0].shape[0] < needed or self._rope[0].device != ref.device:
            length = self._rope_length(needed)
            # LitGPT's RoPE table (all its scaling variants), built for `length` positions only.
            spec = SimpleNamespace(config=self.config, max_seq_length=length)
            self._rope = LitGPT.rope_cache(spec, device=ref.device)  # type: ignore[arg-type]
        return self._rope

    def _check_idx(self, idx: torch.Tensor) -> torch.Tensor:
        """`idx` itself, or widened to int64 when it has a narrower integer dtype (lossless)."""
        check_integer_tensor("idx", idx)
        if idx.dtype not in (torch.int32, torch.int64):
            idx = idx.long()
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        if idx.numel() and self._checks:
            low, high = int(idx.min()), int(idx.max())
            vocab = self.config.padded_vocab_size
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise ValueError(f"token id {bad} is outside the vocabulary: ids must be in [0, {vocab})")
        return idx

    def _check_positions(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """`input_pos` itself, or widened to int64 when it has a narrower integer dtype (lossless)."""
        check_integer_tensor("input_pos", input_pos, what="token positions")
        if input_pos.dtype not in (torch.int32, torch.int64):
            input_pos = input_pos.long()
        if input_pos.shape != idx.shape:
            raise ValueError(f"input_pos must have the shape of idx {tuple(idx.shape)}, got {tuple(input_pos.shape)}")
        caches = self.caches
        if caches is None:
            raise ValueError("input_pos was given but no KV caches are attached: call set_kv_caches() first")
        if idx.shape[0] != caches.batch_size:
            raise ValueError(
                f"batch size changed mid-sequence: the KV caches were built for batch size "
                f"{caches.batch_size}, got idx with batch size {idx.shape[0]}"
            )
        caches.observe(input_pos, check=self._checks)
        return input_pos


class Block(nn.Module):
    """Transformer block: (parallel or sequential) residual attention and MLP, LitGPT's layout."""

    def __init__(self, config: Config, block_idx: int) -> None:
        super().__init__()
        if not config.parallel_residual and config.shared_attention_norm:
            raise NotImplementedError("non-parallel residual with a shared attention norm is not supported")
        norm = config.norm_class
        self.norm_1 = norm(config.n_embd, eps=config.norm_eps) if config.norm_1 else nn.Identity()
        self.attn = MIXERS[layer_kinds(config)[block_idx]](config, block_idx)  # type: ignore[arg-type]
        self.post_attention_norm = (
            norm(config.n_embd, eps=config.norm_eps) if config.post_attention_norm else nn.Identity()
        )
        if not config.norm_2:
            self.norm_2: nn.Module | None = nn.Identity()
        else:
            self.norm_2 = None if config.shared_attention_norm else norm(config.n_embd, eps=config.norm_eps)
        if config.first_k_dense_replace is not None and block_idx < config.first_k_dense_replace:
            from litgpt.model import LLaMAMLP

            self.mlp = LLaMAMLP(config)
        else:
            self.mlp = config.mlp_class(config)
        self.post_mlp_norm = norm(config.n_embd, eps=config.norm_eps) if config.post_mlp_norm else nn.Identity()
        self.config = config

    @property
    def _residual_chain(self) -> bool:
        """Whether the attention's projection goes straight into the residual, then the MLP half: `x + proj(y)`, then
        `+ mlp(norm_2(.))` (no gate, no norm after the attention or the MLP, not parallel)."""
        plain = isinstance(self.post_attention_norm, nn.Identity) and isinstance(self.post_mlp_norm, nn.Identity)
        return plain and not self.config.parallel_residual and getattr(self.attn, "gate", None) is None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        input_pos: torch.Tensor | None,
        no_pads: bool = False,
        evict_later: bool = False,
    ) -> torch.Tensor:
        """`x`: `(B, T, n_embd)`; `cos`/`sin`: `(B or 1, T, rope_n_elem)`; `no_pads`: `input_pos` has no `-1`;
        `evict_later`: the cache's eviction waits for `KVCaches.evict_waiting` (`CausalSelfAttention`)."""
        # a decode step's norm and attention inputs in one C call where they apply (`fused_decode`)
        step = qkv_step(self.norm_1, self.attn.qkv, self.config, x, cos, sin) if self.attn.reads_rope else None
        if step is not None:
            x_normed, q, k, v = step
            heads = self.attn.attend_qkv(x_normed, q, k, v, cos, sin, input_pos, no_pads, evict_later)
            if self._residual_chain:  # the projection, the residual and the MLP half in one C call where it applies
                fused = mlp_step(self.norm_2, self.mlp, x, heads, self.attn.proj)
                if fused is not None:
                    return fused
            mixed = self.attn.project(x_normed, heads)
        elif self.attn.reads_rope:
            x_normed = self.norm_1(x)
            mixed = self.attn(x_normed, cos, sin, input_pos, no_pads, evict_later)
        else:  # a recurrent mixer: positions only
            x_normed = self.norm_1(x)
            mixed = self.attn(x_normed, input_pos)
        attn_out = self.post_attention_norm(mixed)
        if self.config.parallel_residual:
            if self.norm_2 is not None:
                x_normed = self.norm_2(x)
            x = attn_out + x
        else:
            x = attn_out + x
            if isinstance(self.post_mlp_norm, nn.Identity):  # a decode step's MLP half in one C call where it applies
                fused = mlp_step(self.norm_2, self.mlp, x, None, None)
                if fused is not None:
                    return fused
            x_normed = self.norm_2(x)
        return self.post_mlp_norm(self.mlp(x_normed)) + x


def _check_memory(
    c: Config,
    configs: Sequence[KVCacheConfig],
    kinds: Sequence[str],
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """The attention layers' caches against the machine's memory, before any is allocated (`modeling.memory`)."""
    attention = [cfg for cfg, kind in zip(configs, kinds, strict=True) if kind not in RECURRENT_KINDS]
    lengths = [cfg.cache_length for cfg in attention]
    needed = cache_bytes(lengths, [cfg.storage for cfg in attention], batch, c.n_query_groups, c.head_size,
                         torch.empty(0, dtype=dtype).element_size())  # fmt: skip
    option = f"cache_length={max(lengths, default=0)} with batch {batch} and {len(attention)} attention layers"
    check_cache_memory(needed, torch.device(device), option)
