"""A functional decoder forward over Hugging Face weights, with a per-slot static KV cache.

One forward serves every family of the architecture table (:mod:`.families`: Qwen2, Qwen3,
Llama 3, Qwen3-MoE): they share the decoder (RMSNorm, grouped-query attention with RoPE, SwiGLU
MLP) and HF's weight names, and differ in what :class:`~.families.Architecture` says (biases,
Qwen3's per-head q/k norms, head_dim, the rope type, a tied head, Qwen3-MoE's sparse layers:
:mod:`.moe`).

Why not ``model.forward`` with a transformers cache: continuous batching needs each row of the
batch at its own position, rows joining and leaving between steps, and no per-step cache
concatenation. A ~100-line functional forward over the same weights does that directly and
matches ``Qwen2ForCausalLM``'s (``Qwen3ForCausalLM``'s, ``LlamaForCausalLM``'s) logits to ~1e-6 in
fp32 (tested against HF).

Cache layout (per layer): ``k[layer]``, ``v[layer]`` of shape ``[max_batch, kv_heads, capacity,
head_dim]``. Running sequences always occupy slots ``0..B-1`` (the generator compacts slots when
one leaves). Decode rows attend over their slots through :mod:`.attention` (the C kernel on CPU
fp32, matmul runs elsewhere on CPU, a length-masked SDPA on CUDA). New prompts join in the same
packed forward as the decode tokens (one pass over the weights per step). ``capacity`` grows by
doubling up to the context length, so memory follows the longest live sequence. A step of decode
rows only may instead run the static-shape decode of :mod:`.decode_graph` (compiled, and on CUDA
replayed as a CUDA graph).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from areal.serving.attention import choose_attention
from areal.serving.cpu_attention import Mode
from areal.serving.families import architecture_of
from areal.serving.moe import SparseMoe, per_expert, stack_experts

if TYPE_CHECKING:
    from areal.serving.decode_graph import StaticDecode


class ModelSpec:
    """The dimensions the forward needs, read from an HF ``config.json``; its family's
    :class:`~.families.Architecture` as ``arch`` (a family or option not served is refused:
    :class:`~.families.UnsupportedModel`)."""

    def __init__(self, config: dict):
        self.arch = architecture_of(config)
        self.vocab_size = int(config["vocab_size"])
        self.hidden = int(config["hidden_size"])
        self.n_layers = int(config["num_hidden_layers"])
        self.n_heads = int(config["num_attention_heads"])
        self.n_kv_heads = int(config.get("num_key_value_heads") or self.n_heads)
        self.head_dim = self.arch.head_dim
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.max_positions = int(config.get("max_position_embeddings", 2048))
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        eos = config.get("eos_token_id")
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])


def finite_as(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """True when ``t`` holds no NaN or inf once cast to ``dtype``: its min and max (NaN
    propagates) lie in ``dtype``'s finite range. One pass, no cast copy: the cast-then-isfinite
    it replaces took ~3.5 s a check of a 0.5B model on the server's one loading thread."""
    if t.numel() == 0:
        return True
    lo, hi = (float(v) for v in torch.aminmax(t))
    big = torch.finfo(dtype).max
    return -big <= lo and hi <= big


def read_hf_config(path: str | Path) -> dict:
    """``config.json`` of an HF model dir as a dict, its eos ids those of generation_config."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; pass a Hugging Face model directory")
    config = json.loads((path / "config.json").read_text())
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():  # generation_config's eos list is the one generate() stops on
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if eos is not None:
            config = {**config, "eos_token_id": eos}
    return config


def read_hf_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` as a dict (:func:`read_hf_config`) and every ``*.safetensors`` tensor of
    an HF model dir."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    params: dict[str, torch.Tensor] = {}
    for f in files:
        params.update(load_file(str(f)))
    return config, params


class KVCache:
    """Per-layer key/value tensors ``[max_batch, kv_heads, capacity, head_dim]``."""

    def __init__(self, spec: ModelSpec, max_batch: int, max_len: int, device, dtype):
        self.spec, self.max_batch, self.max_len = spec, max_batch, max_len
        self.device, self.dtype = device, dtype
        self.capacity = 0
        self.generation = 0  # bumped whenever the cache tensors are replaced (graphs hold them)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure_capacity(min(256, max_len))

    def ensure_capacity(self, length: int) -> None:
        """Grow (doubling, capped at ``max_len``) so positions ``< length`` fit."""
        if length <= self.capacity:
            return
        new_cap = max(length, min(self.max_len, max(2 * self.capacity, 1)))
        shape = (self.max_batch, self.spec.n_kv_heads, new_cap, self.spec.head_dim)
        for store in (self.k, self.v):
            for i in range(self.spec.n_layers):
                fresh = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if i < len(store):
                    fresh[:, :, : self.capacity] = store[i]
                    store[i] = fresh
                else:
                    store.append(fresh)
        self.capacity = new_cap
        self.generation += 1

    def release(self) -> int:
        """Drop every cached tensor (no request may be running); returns the bytes dropped. The
        next :meth:`ensure_capacity` allocates afresh."""
        freed = sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
        self.k, self.v, self.capacity = [], [], 0
        self.generation += 1
        return freed

    def rows_of(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row indices ``[T * kv_heads]`` of (slot, head, position) in a layer's ``[-1, head_dim]``
        view, for :meth:`write` (valid until the capacity grows)."""
        heads = torch.arange(self.spec.n_kv_heads, device=slots.device)
        rows = (slots[:, None] * self.spec.n_kv_heads + heads) * self.capacity + positions[:, None]
        return rows.flatten()

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v [T, kv_heads, head_dim]`` at ``rows`` (from :meth:`rows_of`)."""
        d = self.spec.head_dim
        self.k[layer].view(-1, d).index_copy_(0, rows, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, rows, v.reshape(-1, d))

    def clear_slot(self, slot: int) -> None:
        """Zero every cached position of ``slot`` (after its request failed on NaN/inf)."""
        for store in (self.k, self.v):
            for t in store:
                t[slot].zero_()

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached positions of slot ``src`` into slot ``dst``."""
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :length] = t[src, :, :length]


class DenseOps:
    """The step's matmuls: oneDNN's (with a fused residual add) on CPU fp32, else torch's.

    On CPU, torch's oneDNN linear ran the decode-step shapes (64..104 rows) ~25% faster than
    ``F.linear``'s MKL path (168 vs 134 GFLOP/s on 2 cores), and its binary post-op folds the
    residual add into the matmul (one pass over the activations and one op dispatch fewer).
    Weights are reordered into oneDNN's blocked layout once (:meth:`pack`) instead of at every
    call: 10-35% faster matmuls at 8..200 rows, +6-11% generation tokens/s end to end (at the
    cost of a packed copy of o_proj, down_proj and lm_head next to the HF-named weights, which
    partial weight updates need; q/k/v and gate/up were copies already). Results
    agree with the unfused ops to fp32 rounding (tested). Folding SiLU and the gate product in
    as well (two matmuls instead of one fused gate/up) measured slower end to end.
    """

    ROWS_HINT = 64  # the row count oneDNN tunes the packed layout for: a full decode batch

    def __init__(self, device: torch.device, dtype: torch.dtype, allow_fused: bool = True):
        op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
        reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
        cpu_fp32 = device.type == "cpu" and dtype == torch.float32
        fused = allow_fused and cpu_fp32 and torch.backends.mkldnn.is_available()
        # (linear, reorder): oneDNN's ops, None where torch's are used
        self._fused_ops = (op, reorder) if fused and op and reorder else None

    @property
    def fused(self) -> bool:
        return self._fused_ops is not None

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` for :meth:`linear`: reordered once into oneDNN's blocked layout where fused."""
        if self._fused_ops is None:
            return w
        return self._fused_ops[1](w.contiguous(), self.ROWS_HINT)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
        """``x @ w.T + b``."""
        if self._fused_ops is None:
            return F.linear(x, w, b)
        return self._fused_ops[0](x, w, b, "none", [], "")

    def linear_add(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        residual: torch.Tensor,
        b: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``residual + x @ w.T + b``."""
        if self._fused_ops is None:
            return residual + F.linear(x, w, b)
        return self._fused_ops[0].binary(x, residual, w, b, "add")


class Qwen2Forward:
    """The decoder of every served family (Qwen2's layout; :mod:`.families` says how Qwen3 and
    Llama depart from it) over a dict of HF-named tensors; weights replaceable in place."""

    def __init__(
        self,
        config: dict,
        params: dict[str, torch.Tensor],
        device,
        dtype,
        cpu_attention: Mode = "auto",
        pack_weights: bool = True,
    ):
        self.spec = ModelSpec(config)
        self.device, self.dtype = torch.device(device), dtype
        # packed oneDNN weights are opaque to torch.compile: the static decode asks for plain ones
        self.ops = DenseOps(self.device, dtype, allow_fused=pack_weights)
        s = self.spec
        group = s.n_heads // s.n_kv_heads
        self.attention = choose_attention(cpu_attention, self.device, dtype, s.n_kv_heads, group)
        self.static: StaticDecode | None = None  # decode-only steps run it when set
        params, problems = per_expert(params)  # fused experts (a trainer's files) -> HF's names
        if problems:
            raise ValueError("; ".join(problems))
        self.params: dict[str, torch.Tensor] = {}
        for name, t in params.items():
            self.params[name] = t.to(device=self.device, dtype=dtype).contiguous()
        # sparse layer -> its experts stacked (gate_up [E, 2I, H], down [E, H, I]); self.params'
        # per-expert weights are views into them
        self.expert_stacks = stack_experts(self.params, self.spec.arch.experts)
        if "lm_head.weight" not in self.params and not self.spec.tie_word_embeddings:
            raise ValueError("weights have no lm_head.weight and tie_word_embeddings is false")
        self._build_fused()
        inv_freq = s.arch.rope.inv_freq(s.head_dim)  # [head_dim / 2], as transformers computes it
        freqs = torch.outer(torch.arange(s.max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        # RoPE as x * cos + roll(x, d/2) * sin_signed: roll swaps the halves, and the sign of
        # rotate_half's negated half moves into the first half of sin.
        half = s.head_dim // 2
        sin = emb.sin()
        self.cos = emb.cos().to(self.device, dtype)
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.device, dtype)

    @property
    def attention_impl(self) -> str:
        """Which eager decode attention runs: ``compiled`` (the C kernel), ``torch`` (matmul
        runs) or ``masked`` (SDPA with a length mask)."""
        return self.attention.name

    @property
    def attention_run(self) -> int | None:
        """Slots per decode-attention run (:mod:`.slots` keeps longer rows first); None = the
        attention reads each row's exact length."""
        return self.attention.run

    @attention_run.setter
    def attention_run(self, run: int) -> None:
        self.attention.run = run

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device="cpu",
        dtype=torch.float32,
        cpu_attention: Mode = "auto",
        pack_weights: bool = True,
    ) -> Qwen2Forward:
        """Load config and safetensors weights of an HF model directory of a served family (one
        that is not is refused before its weights are read)."""
        ModelSpec(read_hf_config(path))  # refuses an unserved family or option in one line
        config, params = read_hf_dir(path)
        return cls(config, params, device, dtype, cpu_attention, pack_weights)

    def _build_fused(self) -> None:
        """Concatenate q/k/v and gate/up weights so each is one matmul per layer, then pack them
        (a sparse layer's experts: :meth:`_mlp_weights`).

        Attention's 1/sqrt(head_dim) is folded into q (RoPE is linear, so scaling first is exact):
        into the q rows of the weights and bias, or with per-head q/k norms (Qwen3), into the q
        norm's weight (the norm would undo a scale before it).
        """
        p, pack, s = self.params, self.ops.pack, self.spec
        scale = s.head_dim**-0.5
        q_scale = 1.0 if s.arch.qk_norm else scale
        self.layers = []
        for i in range(s.n_layers):
            pre = f"model.layers.{i}."
            att = pre + "self_attn."
            qkv_b = qk_norm = o_b = None
            if s.arch.qkv_bias:
                qkv_b = torch.cat(
                    [p[att + "q_proj.bias"] * q_scale] + [p[att + f"{x}_proj.bias"] for x in "kv"]
                )
            if s.arch.qk_norm:  # [q heads + kv heads, head_dim]: one norm op for q and k
                q_norm = (p[att + "q_norm.weight"] * scale).expand(s.n_heads, -1)
                k_norm = p[att + "k_norm.weight"].expand(s.n_kv_heads, -1)
                qk_norm = torch.cat([q_norm, k_norm])
            if s.arch.o_bias:
                o_b = p[att + "o_proj.bias"]
            qkv_w = [p[att + "q_proj.weight"] * q_scale] + [
                p[att + f"{x}_proj.weight"] for x in "kv"
            ]
            self.layers.append(
                dict(
                    ln1=p[pre + "input_layernorm.weight"],
                    ln2=p[pre + "post_attention_layernorm.weight"],
                    qkv_w=pack(torch.cat(qkv_w)),
                    qkv_b=qkv_b,
                    qk_norm=qk_norm,
                    o_w=pack(p[att + "o_proj.weight"]),
                    o_b=o_b,
                    **self._mlp_weights(i),
                )
            )
        self.embed = p["model.embed_tokens.weight"]
        self.final_norm = p["model.norm.weight"]
        self.lm_head = pack(p.get("lm_head.weight", self.embed))

    def _mlp_weights(self, i: int) -> dict:
        """Layer ``i``'s MLP: its router and stacked experts (``experts``) if sparse, else the
        fused gate/up and the down weights, packed."""
        p, pack, mlp = self.params, self.ops.pack, f"model.layers.{i}.mlp."
        if i in self.expert_stacks:
            gate_up, down = self.expert_stacks[i]
            experts = self.spec.arch.experts
            assert experts is not None  # expert_stacks holds sparse layers only
            return dict(experts=SparseMoe(p[mlp + "gate.weight"], gate_up, down, experts))
        gate_up = torch.cat([p[mlp + f"{x}_proj.weight"] for x in ("gate", "up")])
        return dict(experts=None, gate_up_w=pack(gate_up), down_w=pack(p[mlp + "down_proj.weight"]))

    @torch.no_grad()
    def check_weights(self, named: dict[str, torch.Tensor], complete: bool = False) -> list[str]:
        """Problems that make ``named`` unloadable: unknown names, wrong shapes, tensors that are
        not floating point, values that are NaN or inf once cast to the model's dtype (1e300 in
        float64 is finite, inf in float32), and with ``complete`` the weights it lacks (a
        partial state dict). Experts may come fused per layer, as transformers 5 holds them."""
        named, problems = per_expert(named)
        for name, t in named.items():
            if (
                name == "lm_head.weight"
                and name not in self.params
                and self.spec.tie_word_embeddings
            ):
                continue  # tied: lm_head is the embedding, sent separately
            if name not in self.params:
                problems.append(f"unknown weight {name!r}")
            elif tuple(t.shape) != tuple(self.params[name].shape):
                problems.append(
                    f"{name}: shape {tuple(t.shape)} != {tuple(self.params[name].shape)}"
                )
            elif not t.is_floating_point():
                problems.append(
                    f"{name}: dtype {t.dtype} is not floating point; send {self.dtype} "
                    "(or any float dtype: it is cast)"
                )
            elif not finite_as(t, self.dtype):
                problems.append(
                    f"{name}: holds NaN or inf values once cast to {self.dtype} (or values past "
                    "its largest finite one)"
                )
        if complete:
            missing = sorted(set(self.params) - set(named))
            if missing:
                problems.append(f"missing {len(missing)} weight(s), e.g. {missing[:3]}")
        return problems

    def require_loadable(self, named: dict[str, torch.Tensor], complete: bool = False) -> None:
        """ValueError naming the first problems :meth:`check_weights` finds, if any."""
        problems = self.check_weights(named, complete)
        if problems:
            raise ValueError("; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))

    def assign_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Replace (a subset of) weights by HF name; ``named`` has passed
        :meth:`require_loadable` (the generator checks off its scheduler thread)."""
        for name, t in per_expert(named)[0].items():
            if name in self.params:
                self.params[name].copy_(t.to(self.device, self.dtype))
        self._refresh_fused()

    def _refresh_fused(self) -> None:
        """Rebuild the fused weights into the tensors that hold them now (``copy_``: the same
        storage), so a compiled decode and captured CUDA graphs, which read those tensors, see
        the new weights."""
        old_layers, old_head = self.layers, self.lm_head
        self._build_fused()
        for old, new in zip(old_layers, self.layers):
            for key, t in new.items():
                kept = old[key]
                if isinstance(t, torch.Tensor) and isinstance(kept, torch.Tensor):
                    if kept is not t:
                        kept.copy_(t)
                    new[key] = kept
        if old_head is not self.lm_head:
            old_head.copy_(self.lm_head)
            self.lm_head = old_head

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """In fp32, then the weight in the model's dtype, as transformers' RMSNorm (in bf16 the
        variance would lose the bits the trainer keeps); a no-op cast in fp32."""
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)  # F.rms_norm decomposes into more ops on CPU
        return w * (xf * torch.rsqrt(var + self.spec.eps)).to(x.dtype)

    def _qkv(self, h: torch.Tensor, layer: dict, cos, sin) -> tuple[torch.Tensor, ...]:
        """q (pre-scaled) and k after RoPE (Qwen3: after their per-head norms), and v:
        ``[T, heads, head_dim]`` each, of the hidden states ``h [T, H]``."""
        s = self.spec
        nq, nkv, d = s.n_heads, s.n_kv_heads, s.head_dim
        qkv = self.ops.linear(self._rms_norm(h, layer["ln1"]), layer["qkv_w"], layer["qkv_b"])
        qk = qkv[:, : (nq + nkv) * d].view(-1, nq + nkv, d)
        if layer["qk_norm"] is not None:
            qk = self._rms_norm(qk, layer["qk_norm"])
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)  # RoPE: q and k
        return qk[:, :nq], qk[:, nq:], qkv[:, (nq + nkv) * d :].view(-1, nkv, d)

    def _mlp_block(self, h: torch.Tensor, layer: dict) -> torch.Tensor:
        x = self._rms_norm(h, layer["ln2"])
        if layer["experts"] is not None:  # a sparse layer (Qwen3-MoE)
            return h + layer["experts"](x)
        gate, up = self.ops.linear(x, layer["gate_up_w"]).chunk(2, dim=-1)
        return self.ops.linear_add(F.silu(gate) * up, layer["down_w"], h)

    def _prompt_attention(
        self, q, k, v, lens: list[int], last_only: bool, cached: tuple | None = None
    ) -> list[torch.Tensor]:
        """Causal attention within each new prompt (packed after the decode rows).

        A run of consecutive prompts of equal length (e.g. a group's samples of one prompt) is
        one contiguous block, viewed as a batch for one SDPA call. Returns ``[tokens, h*d]``
        per run, in order; with ``last_only``, ``[prompts, h*d]``: each prompt's last token only
        (it sees every key of its prompt, so no mask).

        ``cached`` = ``(starts, k_layer, v_layer, first_slot)``: prompt ``j`` continues the
        ``starts[j]`` tokens cached in slot ``first_slot + j`` (:mod:`.prefix_cache`); its tokens,
        written there too, attend over that slot's keys, token ``t`` up to key ``start + t``."""
        out: list[torch.Tensor] = []
        starts = cached[0] if cached else [0] * len(lens)
        start, j = 0, 0
        while j < len(lens):
            n, s0, m = lens[j], starts[j], 1
            while j + m < len(lens) and lens[j + m] == n and starts[j + m] == s0:
                m += 1
            block = slice(start, start + m * n)
            qs, ks, vs = (t[block].view(m, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            mask = None
            if s0:  # keys and values from the slots: the cached prefix, then these tokens
                assert cached is not None  # starts are all 0 without it
                ks, vs = (c[cached[3] + j : cached[3] + j + m, :, : s0 + n] for c in cached[1:3])
                if not last_only:  # token t sees keys 0 .. s0 + t
                    mask = torch.ones(n, s0 + n, dtype=torch.bool, device=q.device).tril(s0)
            if last_only:
                qs = qs[:, :, -1:]
            att = F.scaled_dot_product_attention(
                qs,
                ks,
                vs,
                attn_mask=mask,
                is_causal=not last_only and mask is None,
                enable_gqa=True,
                scale=1.0,  # q pre-scaled
            )
            out.append(att.transpose(1, 2).reshape(-1, qs.shape[1] * qs.shape[3]))
            start, j = start + m * n, j + m
        return out

    @torch.no_grad()
    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]`` at every position of one sequence (a plain causal forward that
        touches no cache: prompt logprobs for echo / loglikelihood requests)."""
        n = tokens.shape[0]
        positions = torch.arange(n, device=tokens.device)
        cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]
        h = F.embedding(tokens, self.embed)
        for layer in self.layers:
            q, k, v = self._qkv(h, layer, cos, sin)
            (att,) = self._prompt_attention(q, k, v, [n], last_only=False)
            h = self._mlp_block(self.ops.linear_add(att, layer["o_w"], h, layer["o_b"]), layer)
        return self.ops.linear(self._rms_norm(h, self.final_norm), self.lm_head)

    @torch.no_grad()
    def step(
        self,
        decode_tokens: torch.Tensor,
        decode_positions: torch.Tensor,
        prompts: list[torch.Tensor],
        cache: KVCache,
        starts: list[int] | None = None,
    ) -> torch.Tensor:
        """One packed forward: a decode token for each running slot plus whole new prompts.

        ``decode_tokens[b]`` sits at ``decode_positions[b]`` in slot ``b`` (slots ``0..B-1``);
        prompt ``j`` fills slot ``B + j`` from position ``starts[j]`` (default 0; the slot holds
        the cached keys/values before it: :mod:`.prefix_cache`). All tokens share each weight matmul
        (one pass over the weights per step); attention is per row. Returns logits
        ``[B + len(prompts), V]``: the next-token logits of each decode row, then of each
        prompt's last token. The last layer's attention output, o_proj and MLP run on those rows
        only (a prompt's other tokens feed the cache alone). Decode tokens and positions come on
        the host (the cache size is read with no device sync) and are copied to the device here.
        A decode-only step runs :attr:`static` when set (its logits may be a graph's output
        buffer: read them before the next step).
        """
        B = decode_tokens.shape[0]
        host_positions = decode_positions.cpu()  # a no-op for host tensors (the generator's)
        lens = [int(p.shape[0]) for p in prompts]
        starts = starts or [0] * len(lens)
        longest = max([int(host_positions.max()) + 1 if B else 0, *map(sum, zip(starts, lens))])
        cache.ensure_capacity(longest)
        if self.static is not None and B and not prompts:
            return self.static(decode_tokens.cpu(), host_positions, cache)
        dev = self.device
        decode_tokens = decode_tokens.to(dev, non_blocking=True)
        decode_positions = decode_positions.to(dev, non_blocking=True)
        return self._packed_step(decode_tokens, decode_positions, prompts, lens, cache, starts)

    def _packed_step(
        self, decode_tokens, decode_positions, prompts, lens, cache, starts
    ) -> torch.Tensor:
        """:meth:`step`'s eager forward, inputs on the device and the cache large enough."""
        s, dev = self.spec, self.device
        B = decode_tokens.shape[0]
        tokens = torch.cat([decode_tokens, *prompts])
        positions = torch.cat(
            [decode_positions, *(torch.arange(a, a + n, device=dev) for a, n in zip(starts, lens))]
        )
        slots = torch.cat(
            [torch.arange(B, device=dev)]
            + [torch.full((n,), B + j, dtype=torch.long, device=dev) for j, n in enumerate(lens)]
        )
        rows = cache.rows_of(slots, positions)
        cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # [T, 1, d]
        layout = self.attention.layout(decode_positions + 1, cache.capacity)  # shared by layers
        h = F.embedding(tokens, self.embed)  # [T, H]
        ends = torch.tensor(lens, dtype=torch.long, device=dev).cumsum(0) + (B - 1)
        wanted = torch.cat([torch.arange(B, device=dev), ends])  # rows whose logits are returned
        for i, layer in enumerate(self.layers):
            last = i == s.n_layers - 1  # other rows only feed the cache: skip their o_proj and MLP
            q, k, v = self._qkv(h, layer, cos, sin)
            cache.write(i, rows, k, v)
            parts = [self.attention(q[:B], cache.k[i], cache.v[i], layout)] if B else []
            cached = (starts, cache.k[i], cache.v[i], B) if any(starts) else None
            parts += self._prompt_attention(q[B:], k[B:], v[B:], lens, last, cached)
            att = torch.cat(parts) if len(parts) > 1 else parts[0]
            residual = h[wanted] if last and lens else h
            h = self.ops.linear_add(att, layer["o_w"], residual, layer["o_b"])
            h = self._mlp_block(h, layer)
        return self.ops.linear(self._rms_norm(h, self.final_norm), self.lm_head)
