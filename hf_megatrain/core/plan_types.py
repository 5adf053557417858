"""The planner's types: a model's shape, one named cost line, a layer's placement, messages.

Plain dataclasses (no ``transformers`` import): the CLI builds a :class:`ModelShape` from a config
on the meta device, the builder from the model it streams. The step shape and the engine options
the planner reads are :class:`~hf_megatrain.core.options.StepShape` and
:class:`~hf_megatrain.core.options.ResolvedOptions`.

Advice and notes name engine options by their field (``checkpoint_every=3``): a :class:`Message`
keeps the option references structured and an :class:`OptionNamer`, chosen by whoever shows the
message, spells them (the HF layer as training arguments, the CLI as flags).

The plan itself, :class:`~hf_megatrain.core.plan_report.MemoryPlan`, lives in ``plan_report``
(above the arithmetic it reads); this module imports no other planner module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .options import ALL_LAYERS, parse_attention_layers

#: ``LayerPlacement.tier``: the layer's whole state on the GPU.
HBM = "hbm"
#: ``LayerPlacement.tier``: the layer's state in the host store, streamed through the GPU.
HOST = "host"


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a decoder model (parameter counts, not weights)."""

    # Parameters each decoder layer streams, in layer order (LoRA adapters apart, below).
    layer_numels: tuple[int, ...]
    non_layer_numel: int  # embeddings, final norm, LM head (a tied head counted once)
    hidden_size: int
    vocab_size: int
    intermediate_size: int  # MLP width (for MoE: the active experts' total width)
    tied_embeddings: bool = False
    fused_loss: bool = True  # whether training uses the chunked LM head + loss
    name: str = "model"
    # Width of one of k/v (kv heads x head dim); 0 when unknown: taken as hidden_size (an upper
    # bound, so kept-activation estimates err high).
    kv_size: int = 0
    # Width of one attention head; 0 when unknown (then the RoPE tables go uncounted).
    head_dim: int = 0
    # Query heads; 0 when unknown (then taken as hidden_size / head_dim).
    num_heads: int = 0
    # Whether attention normalizes q and k per head (Qwen3's q_norm / k_norm).
    qk_norm: bool = False
    # Whether those norms return fp32 for bf16 q and k once their weights are bound in fp32, as
    # the stock Trainer's are (Llama-style ``weight * x``: Qwen3; Gemma-style norms cast back).
    qk_norm_fp32_output: bool = False
    # Whether RMSNorm and the gated MLP run as fused kernels (Liger-Kernel) that save their
    # inputs only, not their intermediate products (fewer kept-activation bytes).
    fused_layer_kernels: bool = False
    # Whether every norm of the decoder layers runs this library's compiled kernel (Inductor;
    # not Liger-Kernel's): measured to keep no fp32 product in a recomputed layer's backward.
    compiled_norms: bool = False
    # Linears of one decoder layer that read the fp32 residual stream's normed inputs (q, k, v,
    # gate, up: 5; Phi-3's fused qkv and gate-up: 2). Under autocast each saves its own bf16
    # cast of its input (2h per token); with autocast_kernels' shared casts one per input.
    normed_input_linears: int = 5
    # Whether ``kept_activation_bytes_per_token`` is audited for this layer family (exact or
    # above autograd's saved tensors, tests/test_keep_activations.py). When not (Gemma3, the
    # MoE families) "auto" plans no kept activations rather than risk running out of memory.
    kept_bytes_audited: bool = True
    # Gemma-2/3's layer: four RMSNorms (pre and post attention and MLP) computing in fp32 and a
    # GELU-tanh MLP; Gemma3's per-head q/k norms keep an fp32 input and product (see
    # ``kept_activation_bytes_per_token`` and the working set's terms).
    gemma_norms: bool = False
    # Whether the untiled working set's measured-peak line (a gated MLP's backward with the
    # layer's saves alive) is audited for the family (within 4% of the CPU live-tensor tracker:
    # tests/test_plan_accuracy.py); else the earlier line, which the plan's sum covers.
    peak_working_set_audited: bool = False
    # Whether attention runs through PyTorch SDPA, whose fused kernels' outputs
    # keep_attention_outputs keeps (other attention is recomputed: nothing to plan for it).
    sdpa_attention: bool = True
    # transformers' attention implementation (``config._attn_implementation``): "sdpa",
    # "eager" (Gemma-2's default: it materializes every layer's heads x s x s scores and an fp32
    # s x s mask), "flash_attention_2", ... Only "sdpa" and "eager" make s x s masks.
    attn_implementation: str = "sdpa"
    # Window of the layers that attend through a sliding window (0: none does). Under SDPA a
    # sequence at least this long gets an explicit s x s mask instead of ``is_causal``.
    sliding_window: int = 0
    # Whether some layer attends to the whole causal context (with sliding layers: a second mask).
    full_attention_layers: bool = True
    # Per layer, whether it attends through the sliding window (from the config's
    # ``layer_types``); empty when not known: then every layer is taken as sliding when
    # ``sliding_window`` is set (exact for Mistral, Phi-3, ...; an upper bound for mixed models
    # such as Gemma-2's alternating layers). Under SDPA each sliding layer that keeps its
    # activations saves its own additive copy of the mask (``kept_attention_lines``).
    sliding_layers: tuple[bool, ...] = ()
    # Whether attention logits are soft-capped (Gemma-2: a tanh over the eager scores).
    attn_softcapping: bool = False
    # Whether the family's forward always gives SDPA an explicit s x s mask, with or without a
    # window (Falcon: ``allow_is_causal_skip=False``), so every layer is masked as sliding ones.
    sdpa_explicit_mask: bool = False
    # DeepSeek-V3.2's sparse-attention indexer: its heads (0: none). Every layer scores each
    # query against every key per indexer head (fp32, s x s per head) to pick the keys its
    # attention reads, through an explicit mask (``sdpa_explicit_mask``).
    indexer_heads: int = 0
    indexer_head_dim: int = 0
    # The copies of its scores a family's eager attention keeps beyond the line's (scores, fp32
    # softmax and its gradient): (in the compute dtype, in fp32) per element and head. BLOOM's and
    # MPT's ALiBi product, gpt-oss's sinks, GPT-J's attention (CUDA's backward): one compute-dtype
    # copy, a temporary of the backward; XGLM's clamp of the masked scores: one fp32 copy, saved
    # (so kept layers hold it too; hf/family_memory.py).
    eager_score_copies: tuple[int, int] = (0, 0)
    # The family's forward builds a sliding-window mask although no layer uses it (Qwen2-MoE's
    # mask dict; transformers' ``create_sliding_window_causal_mask``): from sequences of this
    # many tokens on (its config's window; 0: always); -1: it builds none.
    unused_window_mask_from: int = -1
    # Bytes per token a recomputed layer's backward holds beyond the working-set line's terms:
    # what a family's own layer adds (measured per family in hf/family_memory.py), described by
    # ``extra_working_set_what``.
    extra_working_set_bytes_per_token: int = 0
    extra_working_set_what: str = ""
    # Bytes per token the family's RoPE function saves per layer beyond the shared cos/sin
    # tables (its own re-laid-out copies of them: ERNIE 4.5, Helium, GLM), measured by calling
    # it (hf/rope_saves.py); held by every recomputed and kept layer.
    rope_saved_bytes_per_token: int = 0
    # Channels per token of the model's cos tables (as many for sin), where it makes one per
    # attention layer type (Gemma 3 and 4: one each, of the type's own width); 0: one table of
    # head_dim.
    rope_table_elements: int = 0
    # Bytes per token of tensors the model's forward hands its layers besides the residual
    # stream that live through the whole step (saved by the layers that read them: Gemma 4's
    # per-layer inputs, the keys and values its later layers reuse; core/carried.py), and of
    # their gradients while the layers' backward runs (summed over the layers that read them);
    # ``carried_what`` names them.
    carried_bytes_per_token: int = 0
    carried_grad_bytes_per_token: int = 0
    carried_what: str = ""
    # Hidden states per token a layer takes in and hands on (Gemma 3n's AltUp: its 4
    # predictions of the hidden state; a hyper-connection family's streams; 1 for most): the
    # boundary activations, their gradients and the segment caches are ``residual_width`` per
    # token.
    residual_streams: int = 1
    # Bytes per token a kept layer of the family saves beyond the count of
    # ``kept_activation_bytes_per_token`` (fitted per family on saved tensors,
    # hf/family_memory.py; negative where it saves less).
    extra_kept_bytes_per_token: int = 0
    # Whether the training loss adds an MoE router load-balancing ("aux") loss (a family's
    # ``output_router_logits`` on), whose temporaries ``router_aux_loss_lines`` plans from: the
    # layers that route (0: every layer), the experts per layer and per token, and whether
    # transformers' loss one-hot encodes every layer's top-k choices at once (before 5.16;
    # the default, the larger) or goes layer by layer.
    router_aux_loss: bool = False
    router_layers: int = 0
    num_experts: int = 0
    # Routed experts per token (MoE; 0 for a dense model): the working set's routed-experts term
    # and, with the aux loss on, its temporaries.
    experts_per_token: int = 0
    # Whether MLP tiles apply to every dense layer (its MLP a one-input module: not BLOOM's,
    # which takes the residual, nor OPT's fc1/fc2 called by the layer itself); where not, the
    # plan counts the untiled MLP whatever ``mlp_tile_tokens`` asks.
    mlp_tileable: bool = True
    # Whether that term is audited for the family (within 5%: its own estimate kind); else the
    # line carries the dense working set's larger error.
    moe_working_set_audited: bool = False
    # Whether the routing weights stay fp32 (Mixtral, GraniteMoE): fp32 weighted expert outputs.
    fp32_routing_weights: bool = False
    # MLP width of the shared expert(s) every token runs besides the routed ones (0: none).
    shared_expert_size: int = 0
    # In an MoE model, the MLP width of its dense layers (DeepSeek's and GLM-4-MoE's first
    # layers, Qwen-MoE's ``mlp_only_layers``); 0 where every layer routes.
    dense_mlp_size: int = 0
    router_aux_one_hot: bool = True
    # Per layer, its parameters that stream frozen (a LoRA base's: the host store keeps their
    # fp32 master and compute-dtype copy, no gradient or moments); empty: none is frozen.
    frozen_layer_numels: tuple[int, ...] = ()
    # LoRA (PEFT): per layer, its adapters' parameters, which train resident on the GPU beside
    # the frozen base that streams (not in ``layer_numels``); empty: none.
    adapter_layer_numels: tuple[int, ...] = ()
    # What a layer's PEFT adapters hold in its recomputed backward (hf/adapter_memory.py; the
    # most any layer's hold, term by term): per token, the compute-dtype and fp32 elements and
    # 1-byte dropout masks they save for their gradients, their largest temporary (compute-dtype,
    # fp32 elements) and the MLP width whose gated backward runs in fp32 (methods that hand an
    # fp32 output back); per forward, the weight-sized tensors some methods make: the elements
    # saved and the largest temporary (compute-dtype, fp32). The adapter methods, for the line's
    # name: ``adapter_activation_line``.
    adapter_token_elements: int = 0
    adapter_token_fp32: int = 0
    adapter_token_masks: int = 0
    adapter_token_peak: tuple[int, int] = (0, 0)
    adapter_fp32_mlp_width: int = 0
    adapter_weight_elements: int = 0
    adapter_weight_fp32: int = 0
    adapter_weight_peak: tuple[int, int] = (0, 0)
    adapter_methods: str = ""
    # Buffers of the adapter layers, resident on the GPU (BOFT's permutation matrices): per
    # layer its own, and those several layers share (VeRA's projections) once.
    adapter_layer_buffer_bytes: tuple[int, ...] = ()
    adapter_shared_buffer_bytes: int = 0
    # Non-layer parameters that do not train (a LoRA base's embeddings, norm and head): fp32 on
    # the GPU, no gradient or moments; whether the input embedding and the LM head are among
    # them (no embedding gradient, no fp32 head gradient in the fused loss).
    frozen_non_layer_numel: int = 0
    frozen_embedding: bool = False
    frozen_head: bool = False
    # Elements a save copies, a shard at a time, while transformers reverts the model's fused
    # weights to the checkpoint's layout: the reverted pieces that are not contiguous (0 for
    # the MoE experts transformers fuses today; hf/conversions.py).
    save_copy_numel: int = 0
    # The largest single parameter of a decoder layer: a save writes each tensor whole, so an
    # HBM-tier layer's (a fused MoE expert tensor) may be copied to the host beyond a shard.
    largest_layer_param_numel: int = 0

    def layer_frozen_numel(self, i: int) -> int:
        """Frozen parameters of layer ``i`` (``frozen_layer_numels``; 0 when none are)."""
        return self.frozen_layer_numels[i] if self.frozen_layer_numels else 0

    def layer_trained_numel(self, i: int) -> int:
        """Streamed parameters of layer ``i`` that train (gradient and moments; a frozen layer's
        none)."""
        return max(0, self.layer_numels[i] - self.layer_frozen_numel(i))

    def trained_numels(self, first: int) -> list[int]:
        """``layer_trained_numel`` of layers ``first`` onwards (the host layers after a tier of
        ``first``): what their gradients hold."""
        if not self.frozen_layer_numels:  # (every layer trains: the searches plan it often)
            return list(self.layer_numels[first:])
        return [self.layer_trained_numel(i) for i in range(first, self.num_layers)]

    @property
    def tier_layers(self) -> int:
        """How many layers the HBM tier can take: the leading ones that train (the tier holds
        their optimizer state; the layers of a frozen LoRA base all stream)."""
        frozen = (i for i in range(self.num_layers) if self.layer_frozen_numel(i))
        return next(frozen, self.num_layers)

    @property
    def adapter_numel(self) -> int:
        """Every layer's LoRA adapter parameters (``adapter_layer_numels``)."""
        return sum(self.adapter_layer_numels)

    @property
    def adapter_buffer_bytes(self) -> int:
        """The adapter layers' resident buffers (``adapter_layer_buffer_bytes`` and the shared)."""
        return sum(self.adapter_layer_buffer_bytes) + self.adapter_shared_buffer_bytes

    @property
    def adapter_activations(self) -> bool:
        """Whether the layers' adapters hold anything in a recomputed backward."""
        return bool(
            self.adapter_token_elements or self.adapter_token_fp32 or self.adapter_token_masks
            or any(self.adapter_token_peak) or self.adapter_fp32_mlp_width
            or self.adapter_weight_elements or self.adapter_weight_fp32
            or any(self.adapter_weight_peak)
        )  # fmt: skip

    @property
    def residual_width(self) -> int:
        """Elements per token of what one layer hands the next (``residual_streams``)."""
        return self.hidden_size * self.residual_streams

    @property
    def num_layers(self) -> int:
        return len(self.layer_numels)

    @property
    def layer_numel(self) -> int:
        return sum(self.layer_numels)

    @property
    def total_numel(self) -> int:
        return self.layer_numel + self.non_layer_numel + self.adapter_numel

    def with_num_layers(self, n: int) -> ModelShape:
        """The same family shape with ``n`` layers (each like the largest current one)."""
        big = max(self.layer_numels, default=0)
        frozen, adapters = self.frozen_layer_numels, self.adapter_layer_numels
        buffers = self.adapter_layer_buffer_bytes
        if frozen:  # (each like the largest layer, its frozen part and adapters too)
            frozen = (frozen[self.layer_numels.index(big)],) * n
        if adapters:
            adapters = (adapters[self.layer_numels.index(big)],) * n
        if buffers:
            buffers = (buffers[self.layer_numels.index(big)],) * n
        pattern = self.sliding_layers
        sliding = tuple(pattern[i % len(pattern)] for i in range(n)) if pattern else ()
        return replace(
            self,
            layer_numels=(big,) * n,
            frozen_layer_numels=frozen,
            adapter_layer_numels=adapters,
            adapter_layer_buffer_bytes=buffers,
            sliding_layers=sliding,
            # Every layer like the largest: a routing one where some route.
            router_layers=n if self.router_layers else 0,
            name=f"{self.name} x{n} layers",
        )


def last_recomputed(recomputed: list[int], count: int) -> list[int]:
    """The layers (of those recomputed in backward, in order) that keep their attention
    kernel's outputs: the last ``count``."""
    return recomputed[len(recomputed) - count :] if count > 0 else []


@dataclass(frozen=True)
class MemoryLine:
    """One named cost of the plan.

    ``kind`` names the sort of cost (one of the ``*_KIND`` names of ``activation_memory`` and
    ``plan_arithmetic``), which ``benchmarks/plan_vs_measured.py`` audits per kind. ``error`` is
    the largest underestimate measured for that kind, as a fraction of ``nbytes``: 0 for buffers
    this library allocates itself (their size is exact), the measured error for estimates of
    framework temporaries. The plan's slack line is the sum of ``nbytes x error`` over its
    lines plus the allocator's fragmentation (``plan_arithmetic.slack_line``).
    """

    name: str
    nbytes: int
    kind: str = ""
    error: float = 0.0

    @property
    def margin(self) -> int:
        """Bytes this line may be short by, at its kind's largest measured error."""
        return int(self.nbytes * self.error)


@dataclass(frozen=True)
class LayerPlacement:
    index: int
    numel: int
    tier: str  # HBM or HOST
    gpu_bytes: int  # persistent GPU bytes of this layer's own state (0 for host layers)
    host_bytes: int


# ==== naming options in messages ====================================================================
def field_setting(name: str, value: Any) -> str:
    """The core's spelling of an option set to a value: ``checkpoint_every=3``,
    ``boundary_dtype='bfloat16'``."""
    return f"{name}={value!r}"


def field_option(name: str) -> str:
    """The core's spelling of an option itself: its field name."""
    return name


@dataclass(frozen=True)
class OptionNamer:
    """How a message spells engine options, chosen by the layer that shows it.

    ``setting(field, value)``: the option set to a value; ``option(field)``: the option itself;
    ``clipping_off``: the training setting without gradient clipping (not an engine option).
    The defaults are the core's field names (``checkpoint_every=3``, ``clipping off``); the HF
    layer passes one that spells its training arguments, ``hf-megatrain plan`` one that spells
    its command-line flags.
    """

    setting: Callable[[str, Any], str] = field_setting
    option: Callable[[str], str] = field_option
    clipping_off: str = "clipping off"


#: The core's own naming (option field names).
FIELD_NAMER = OptionNamer()

#: What each changed option costs besides compute or PCIe, said after its name in advice.
_CAVEATS: dict[tuple[str, Any], str] = {
    ("boundary_dtype", "bfloat16"): "approximate gradients",
}
#: Said after ``OptionNamer.clipping_off``.
CLIPPING_OFF_CAVEAT = "changes the training"


@dataclass(frozen=True)
class OptionChanges:
    """Engine option changes (field -> value, in the order advice lists them) and whether the
    run turns gradient clipping off, as advice carries them."""

    options: Mapping[str, Any] = field(default_factory=dict)
    clipping_off: bool = False

    def render(self, namer: OptionNamer | None = None) -> str:
        """``checkpoint_every=3, boundary_dtype='bfloat16' (approximate gradients)`` in the
        namer's spelling."""
        namer = namer or FIELD_NAMER
        parts = []
        for name, value in self.options.items():
            caveat = _CAVEATS.get((name, value))
            text = namer.setting(name, value)
            parts.append(f"{text} ({caveat})" if caveat else text)
        if self.clipping_off:
            parts.append(f"{namer.clipping_off} ({CLIPPING_OFF_CAVEAT})")
        return ", ".join(parts)

    def __str__(self) -> str:
        return self.render()


Part = str | Callable[[OptionNamer], str]


def setting(name: str, value: Any) -> Callable[[OptionNamer], str]:
    """A message part: option ``name`` set to ``value``, spelled by the namer."""
    return lambda namer: namer.setting(name, value)


def option(name: str) -> Callable[[OptionNamer], str]:
    """A message part: option ``name`` itself, spelled by the namer."""
    return lambda namer: namer.option(name)


@dataclass(frozen=True)
class Message:
    """Text whose option references are spelled when it is shown: ``str`` gives the core's
    spelling, ``render(namer)`` another layer's."""

    parts: tuple[Part, ...] = ()

    @classmethod
    def of(cls, *parts: Part | Message) -> Message:
        out: list[Part] = []
        for p in parts:
            out.extend(p.parts if isinstance(p, Message) else (p,))
        return cls(tuple(out))

    def render(self, namer: OptionNamer | None = None) -> str:
        namer = namer or FIELD_NAMER
        return "".join(p if isinstance(p, str) else p(namer) for p in self.parts)

    def __str__(self) -> str:
        return self.render()

    def __add__(self, other: Message | str) -> Message:
        return Message.of(self, other)

    def __radd__(self, other: str) -> Message:
        return Message.of(other, self)

    def __contains__(self, text: str) -> bool:
        return text in str(self)


class MemoryPlanError(MemoryError):
    """The model/step does not fit; raised before any allocation.

    ``tier`` is ``"gpu"`` or ``"host"``; ``needed`` / ``available`` are bytes. ``advice``: the
    option changes that would make the plan fit, when the planner found some. ``str()`` spells
    options by field name; ``message(namer)`` in another layer's spelling.
    """

    def __init__(
        self,
        message: Message | str,
        tier: str,
        needed: int,
        available: int,
        advice: OptionChanges | None = None,
        namer: OptionNamer | None = None,
    ) -> None:
        self.text = message if isinstance(message, Message) else Message((message,))
        self.namer = namer
        super().__init__(self.text.render(namer))
        self.tier = tier
        self.needed = needed
        self.available = available
        self.advice = advice

    def message(self, namer: OptionNamer | None = None) -> str:
        return self.text.render(namer or self.namer)

    def extend(self, more: Message | str, advice: OptionChanges | None = None) -> None:
        """Append ``more`` (advice) to the message; record ``advice`` when given."""
        self.text = Message.of(self.text, " ", more)
        self.args = (self.text.render(self.namer),)
        if advice is not None:
            self.advice = advice

    def named(self, namer: OptionNamer | None) -> MemoryPlanError:
        """The same problem, its message (``str``, ``args``) in ``namer``'s spelling."""
        return MemoryPlanError(
            self.text, self.tier, self.needed, self.available, self.advice, namer
        )


__all__ = [
    "ALL_LAYERS",
    "CLIPPING_OFF_CAVEAT",
    "FIELD_NAMER",
    "HBM",
    "HOST",
    "LayerPlacement",
    "MemoryLine",
    "MemoryPlanError",
    "Message",
    "ModelShape",
    "OptionChanges",
    "OptionNamer",
    "field_option",
    "field_setting",
    "itemsize",
    "last_recomputed",
    "option",
    "parse_attention_layers",
    "setting",
]
