"""What PEFT adapters hold on the GPU in a streamed layer's backward: the plan shape's
``ModelShape.adapter_*`` fields, read from the adapter modules of the decoder layers.

Every layer under PEFT is recomputed (a frozen layer cannot join the HBM tier), so its backward
holds, beside the frozen base's working set, what its adapters save for their own gradients
(per token: a cast of their input, rank-wide products, dropout masks; per forward: the
weight-sized tensors some methods make and save, a delta weight or a rotated weight) and, for a
moment, the largest of their temporaries (in the recompute, or in their backward). Each method's
terms follow its ``peft.tuners.<method>.layer`` forward under autocast, the base weight the
bound compute-dtype copy; they were checked one adapted linear at a time
(dev/adapter_memory_probe.py) and a whole step at a time (tests/test_plan_accuracy.py,
``test_peft_step_stays_inside_the_plan``) on the CPU live-tensor tracker.

PEFT's methods are told apart by the module of their layer classes, so nothing here imports peft.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

#: Methods whose layers hand their output back in the input's dtype (``result.to(x.dtype)``):
#: under autocast, where a linear's input is the fp32 residual stream's normed copy, an fp32
#: output where the base's is compute-dtype. Only in the MLP does that reach the layer's peak:
#: the gated MLP's backward holds its gate and up outputs, the activation, the product and their
#: gradients in fp32 (measured: 12 B more per token and MLP-width element in bf16; the attention
#: projections' outputs, 0 more).
UPCASTING_METHODS = frozenset({"loha", "lokr", "vera", "oft", "boft", "hra", "fourierft"})

#: Names of a decoder layer's MLP module (its input projections' outputs feed the activation).
_MLP_NAMES = ("mlp", "feed_forward", "ffn")

#: The tuner layer classes around a linear (or, ``ParamWrapper``, a parameter) this models.
_LINEAR_CLASSES = frozenset({"Linear", "SVDLinear", "HRALinear", "FourierFTLinear", "ParamWrapper"})


@dataclass
class _Held:
    """Elements one layer's adapters hold: saved per token (compute dtype, fp32, 1-byte masks),
    saved per forward (weight-sized), and the largest temporary per token and per forward (each
    a compute-dtype and an fp32 count, of the adapted linear where it is largest in bf16)."""

    token: int = 0
    token_fp32: int = 0
    masks: int = 0
    token_peak: tuple[int, int] = (0, 0)
    weight: int = 0
    weight_fp32: int = 0
    weight_peak: tuple[int, int] = (0, 0)
    fp32_mlp: int = 0
    methods: tuple[str, ...] = ()  # (of every layer: the line's name)

    def absorb(self, other: _Held, methods: set[str]) -> None:
        """Keep each term's larger of this and ``other`` (another layer's), and ``methods``."""
        self.token = max(self.token, other.token)
        self.token_fp32 = max(self.token_fp32, other.token_fp32)
        self.masks = max(self.masks, other.masks)
        self.peak("token_peak", *other.token_peak)
        self.weight = max(self.weight, other.weight)
        self.weight_fp32 = max(self.weight_fp32, other.weight_fp32)
        self.peak("weight_peak", *other.weight_peak)
        self.fp32_mlp = max(self.fp32_mlp, other.fp32_mlp)
        self.methods = tuple(sorted(set(self.methods) | methods))

    def peak(self, which: str, compute: int, fp32: int) -> None:
        """Keep the larger temporary (by its bf16 bytes)."""
        old = getattr(self, which)
        if 2 * compute + 4 * fp32 > 2 * old[0] + 4 * old[1]:
            setattr(self, which, (compute, fp32))


def _method(module: nn.Module) -> str | None:
    """The PEFT method of a tuner layer (``peft.tuners.<method>.layer``), None for others."""
    if not any(c.__name__ == "BaseTunerLayer" for c in type(module).__mro__):
        return None
    parts = type(module).__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["peft", "tuners"] else "unknown"


def _trains(module: nn.Module, adapter: str) -> bool:
    """Whether adapter ``adapter`` of the tuner layer has a parameter that trains (its own, not
    the wrapped base layer's)."""
    return any(
        p.requires_grad and adapter in name.split(".")
        for name, p in module.named_parameters()
        if not name.startswith("base_layer.")
    )


def _dropout(module: nn.Module, attr: str, adapter: str) -> bool:
    """Whether the adapter's dropout module (``module.<attr>[adapter]``) drops anything."""
    drops = getattr(module, attr, None)
    drop = drops[adapter] if drops is not None and adapter in drops else None
    return isinstance(drop, nn.Dropout) and drop.p > 0


def _add_module(held: _Held, module: nn.Module, method: str, adapter: str, k: int) -> str | None:
    """Add one adapter of one tuner layer: its method's name ("dora" for LoRA's DoRA), None
    where the layout is not known (its parameters are still planned, resident; nothing else)."""
    cls = type(module).__name__
    if cls not in _LINEAR_CLASSES:  # (an embedding's or convolution's adapter)
        return None
    n_in, n_out = int(getattr(module, "in_features", 0)), int(getattr(module, "out_features", 0))
    w = n_in * n_out
    if method == "lora" and cls == "ParamWrapper":
        # target_parameters: W + B A (x scaling) made at each forward in W's dtype and read by
        # the module that owns W, which then saves it (input gradient) and its input (W's
        # gradient: per routed token for an expert stack). A single weight's B A and its scaled
        # copy are compute-dtype temporaries besides (an expert stack folds B A in by baddbmm).
        experts = int(getattr(module, "num_experts", 1) or 1)
        param = module.get_param()
        held.token += (k if experts > 1 else 1) * n_in
        held.weight += param.numel()
        held.peak("weight_peak", 2 * param.numel() if experts == 1 else 0, 0)
        return method
    if method == "lora" and cls == "Linear":
        r = module.r[adapter]
        drop = _dropout(module, "lora_dropout", adapter)
        # Its own cast of its input (A's) and A's output (B's); a dropout's mask and the fp32
        # gradient it passes back.
        held.token += n_in + r
        held.masks += n_in if drop else 0
        dora = adapter in getattr(module, "lora_magnitude_vector", {})
        if not dora:
            held.peak("token_peak", 0, n_in if drop else 0)
            return method
        # DoRA (lora/dora.py): the base output and the scaled adapter output saved for the
        # magnitude's gradient, fp32 products of both and their sum (3 fp32 gradients in
        # backward). Each forward: W + s B A's norm from an fp32 copy of W, the fp32 B A (made
        # from an identity of the input width, kept in its graph as a compute-dtype cast), the
        # scaled and summed copies; with dropout the base output is recomputed from the fp32
        # W's compute-dtype cast, which F.linear saves.
        held.token += 2 * n_out
        held.peak("token_peak", 0, max(3 * n_out, n_in if drop else 0))
        held.weight += w if drop else 0
        held.peak("weight_peak", n_in * n_in + w, n_in * n_in)  # identity, its cast, B A
        held.peak("weight_peak", n_in * n_in, 4 * w)  # after: W, B A, scaled, summed in fp32
        return "dora"
    if method == "adalora":
        # Like LoRA; the division by the rank count (an fp32 tensor) gives an fp32 output.
        r = module.lora_A[adapter].shape[0]
        drop = _dropout(module, "lora_dropout", adapter)
        held.token += n_in + r
        held.masks += n_in if drop else 0
        held.peak("token_peak", 0, max(n_out, n_in if drop else 0))
        return method
    if method == "ia3":
        # The scaled tensor saved for the scale's gradient: the feed-forward input as an fp32
        # copy, else the base output; the fp32 product's gradient and its cast back.
        if module.is_feedforward:
            held.token_fp32 += n_in
            held.peak("token_peak", 0, 2 * n_in)
        else:
            held.token += n_out
            held.peak("token_peak", 0, 2 * n_out)
        return method
    if method in ("loha", "lokr", "fourierft"):
        # A delta weight made each forward and applied by F.linear, which saves its input's
        # cast (the delta's gradient) and the delta's compute-dtype copy (the input's).
        # Temporaries: LoHa's two products, their product and fp32 backward products (16 B per
        # weight element in bf16); LoKr's fp32 Kronecker product, scaled copy and their
        # gradients (12 B); FourierFT's fp32 dense spectrum, its complex64 copy and inverse FFT
        # (20 B).
        held.token += n_in
        held.weight += w
        peak = {"loha": (2 * w, 3 * w), "lokr": (0, 3 * w), "fourierft": (0, 5 * w)}[method]
        held.peak("weight_peak", *peak)
    elif method == "vera":
        # The shared frozen projections' compute-dtype slices (each adapted linear casts its
        # own), saved for the input gradient; per token the rank-wide product and the
        # output-wide one saved for the two scale vectors' gradients.
        r = module.vera_lambda_d[adapter].shape[0]
        held.token += r + n_out
        held.masks += n_in if _dropout(module, "vera_dropout", adapter) else 0
        held.weight += r * (n_in + n_out)
    elif method == "oft":
        # The input rotated block by block (einsum): its cast saved, its gradient and a permuted
        # copy in backward. The rotation (blocks x block^2 = input width x block elements) from
        # the Cayley-Neumann series: its fp32 powers saved, as many more for a moment.
        block = int(getattr(module.oft_R[adapter], "block_size", 0) or 0)
        rotation = n_in * block
        held.token += n_in
        held.peak("token_peak", 2 * n_in, 0)
        held.weight_fp32 += 4 * rotation
        held.peak("weight_peak", 0, 3 * rotation)
    elif method == "boft":
        # An input-width x input-width rotation per forward from each butterfly factor's
        # permutation buffer: the permutations' casts (two per factor), the chained products,
        # the identity's and the rotation's casts saved; the fp32 identity, block diagonals
        # and rotation for a moment. Per token, the rotated input's cast and the base output
        # (the scale's gradient).
        factors = int(module.boft_P.shape[0])
        held.token += n_in + n_out
        held.weight += (3 * factors + 1) * n_in * n_in
        held.peak("weight_peak", 0, (factors + 2) * n_in * n_in)
    elif method == "hra":
        # The Householder product of r reflections, input-width square: each step's
        # compute-dtype cast saved, the identity's; then W times it, saved by F.linear. The fp32
        # running product, the next one and the outer identity for a moment.
        r = int(module.hra_r[adapter])
        held.token += n_in
        held.weight += (r + 1) * n_in * n_in + w
        held.peak("weight_peak", 0, 3 * n_in * n_in)
    else:
        return None
    return method


def adapter_shape_fields(
    layers: nn.ModuleList, hidden: int, mlp_width: int, experts_per_token: int
) -> dict:
    """``ModelShape.adapter_*`` (activations and buffers) of a PEFT model's decoder layers: the
    most any one layer's adapters hold (each term's largest over the layers), and the adapter
    layers' buffers, resident on the GPU (BOFT's permutations, VeRA's shared projections,
    counted once)."""
    best = _Held()
    own_buffers: list[int] = []
    seen: dict[int, int] = {}  # buffer storage -> the layer where first seen
    shared = 0
    for index, layer in enumerate(layers):
        held = _Held()
        methods: set[str] = set()
        buffers = 0
        for name, module in layer.named_modules():
            method = _method(module)
            if method is None:
                continue
            # Its own buffers (in its submodules too: VeRA's BufferDicts), not the base's.
            own = (b for n, b in module.named_buffers() if not n.startswith("base_layer."))
            for b in own:
                # By storage: views of one (OFT's row and column indices) count once.
                meta = b.device.type == "meta"
                key = id(b) if meta else b.untyped_storage().data_ptr()
                size = b.numel() * b.element_size() if meta else b.untyped_storage().nbytes()
                if key not in seen:
                    seen[key] = index
                    buffers += size
                elif seen[key] != index and seen[key] >= 0:
                    # Shared by several layers (VeRA's): counted once, apart from the layers.
                    own_buffers[seen[key]] -= size
                    shared += size
                    seen[key] = -1
            for adapter in getattr(module, "active_adapters", ()):
                if not _trains(module, adapter):
                    continue
                label = _add_module(held, module, method, adapter, experts_per_token)
                if label:
                    methods.add(label)
                    if method in UPCASTING_METHODS and _feeds_mlp(name, module, hidden):
                        held.fp32_mlp = max(held.fp32_mlp, min(module.out_features, mlp_width))
        own_buffers.append(buffers)
        best.absorb(held, methods)
    fields = dict(
        adapter_token_elements=best.token,
        adapter_token_fp32=best.token_fp32,
        adapter_token_masks=best.masks,
        adapter_token_peak=best.token_peak,
        adapter_fp32_mlp_width=best.fp32_mlp,
        adapter_weight_elements=best.weight,
        adapter_weight_fp32=best.weight_fp32,
        adapter_weight_peak=best.weight_peak,
        adapter_methods=",".join(best.methods),
    )
    if any(own_buffers) or shared:
        fields.update(
            adapter_layer_buffer_bytes=tuple(own_buffers), adapter_shared_buffer_bytes=shared
        )
    return fields


def _feeds_mlp(name: str, module: nn.Module, hidden: int) -> bool:
    """Whether the adapted linear ``name`` (relative to its layer) is an input projection of the
    layer's MLP: inside it, reading the hidden size, not writing it (the output projection)."""
    in_mlp = any(part in _MLP_NAMES for part in name.split("."))
    return in_mlp and module.in_features == hidden and module.out_features != hidden
