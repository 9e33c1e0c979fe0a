"""A built-in synthetic training trace: a GPT-style decoder, with no capture needed.

It is what ``tierflow demo`` runs on when nothing else is given, and what tests use to
get a realistic shape (weights reused in forward, backward and the optimizer step;
activations saved in forward and consumed in reverse; AdamW state that lives across
iterations) without PyTorch. Op times come from a roofline: ``max(flops / peak,
bytes / memory bandwidth)`` on the hardware's compute device.

Ops carry what recompute policies read (:class:`tierflow.trace.Op`): module scopes as a
captured model of the same shape would have them (``wte``, ``blocks.N.attn``,
``blocks.N.mlp``, ``lm_head``; a backward op the scope of the forward op it
differentiates; optimizer ops none), ``rng`` on the dropout ops :func:`gpt_trace`
adds when asked, and ``pure=False`` on optimizer updates, which rewrite weights and
state in place. :func:`training_trace` scopes its layers ``layers.N``.
"""

from __future__ import annotations

import dataclasses

from .hardware import Hardware, load_hardware
from .trace import Op, TensorInfo, Trace

MB = 1_000_000


def gpt_trace(
    hardware: Hardware,
    *,
    layers: int = 24,
    d_model: int = 2048,
    batch: int = 8,
    seq: int = 1024,
    vocab: int = 50304,
    dtype_bytes: int = 2,
    dropout: bool = False,
) -> Trace:
    """One training iteration (forward, backward, AdamW step) of a GPT-style decoder.

    Args:
        hardware: its compute peak and memory bandwidth set the op times.
        layers, d_model, batch, seq, vocab: the model and batch shape.
        dtype_bytes: 2 (bf16, tensor-core peak) or 4 (fp32 peak).
        dropout: add GPT-2's residual dropout after each block's attention projection
            and MLP: a forward op that draws a one-byte-per-element mask (``rng``),
            saved for its backward op. Off by default, as in the zoo models.

    Returns:
        A :class:`Trace` named ``gpt-L{layers}-d{d_model}-b{batch}x{seq}`` (with
        ``-dropout`` appended when ``dropout``).

    Example:
        >>> from tierflow.hardware import load_hardware
        >>> tr = gpt_trace(load_hardware("g10-a100"), layers=2, d_model=256, batch=2, seq=128, dropout=True)
        >>> sorted({o.scope for o in tr.ops if o.phase == "forward"})
        ['blocks.0.attn', 'blocks.0.mlp', 'blocks.1.attn', 'blocks.1.mlp', 'lm_head', 'wte']
        >>> [o.scope for o in tr.ops if o.rng]
        ['blocks.0.attn', 'blocks.0.mlp', 'blocks.1.attn', 'blocks.1.mlp']
    """
    peak = hardware.compute.peak_flops_bf16 if dtype_bytes == 2 else hardware.compute.peak_flops_fp32
    mem_bw = hardware.compute.mem_bandwidth
    tensors: list[TensorInfo] = []
    ops: list[Op] = []
    tokens = batch * seq
    d = d_model

    def tensor(nbytes: int, kind: str, name: str, persistent: bool = False) -> int:
        tensors.append(TensorInfo(len(tensors), int(nbytes), kind, persistent, name))
        return len(tensors) - 1

    def op(name: str, phase: str, flops: float, ins: tuple[int, ...], outs: tuple[int, ...],
           scope: str | None, rng: bool = False, pure: bool = True) -> None:
        moved = sum(tensors[t].bytes for t in set(ins + outs))
        ops.append(Op(name, phase, max(flops / peak, moved / mem_bw), ins, outs, scope=scope, rng=rng, pure=pure))

    def drop(i: int, part: str, x: int) -> tuple[int, int]:
        """Residual dropout on ``x``: its output and the mask saved for backward."""
        mask = tensor(tokens * d, "activation", f"h{i}.{part}.mask")
        y = tensor(act, "activation", f"h{i}.{part}.drop")
        op(f"h{i}.{part}.dropout", "forward", 0, (x,), (y, mask), f"blocks.{i}.{part}", rng=True)
        return y, mask

    act = tokens * d * dtype_bytes
    ids = tensor(tokens * 8, "input", "input_ids")
    emb = tensor(vocab * d * dtype_bytes, "parameter", "wte", True)
    shapes = {"qkv": 3 * d * d, "proj": d * d, "fc": 4 * d * d, "out": 4 * d * d}
    params = [{k: tensor(n * dtype_bytes, "parameter", f"h{i}.{k}", True) for k, n in shapes.items()} for i in range(layers)]

    # forward: each layer saves its input and four intermediates for backward
    x = tensor(act, "activation", "x0")
    op("embedding", "forward", 0, (ids, emb), (x,), "wte")
    saved = []
    masks: list[tuple[int, int]] = []
    for i, p in enumerate(params):
        attn, mlp = f"blocks.{i}.attn", f"blocks.{i}.mlp"
        qkv = tensor(3 * act, "activation", f"h{i}.qkv")
        op(f"h{i}.qkv", "forward", 2 * tokens * d * 3 * d, (x, p["qkv"]), (qkv,), attn)
        ctx = tensor(act, "activation", f"h{i}.ctx")
        op(f"h{i}.attn", "forward", 4 * tokens * seq * d, (qkv,), (ctx,), attn)
        h = tensor(act, "activation", f"h{i}.h")
        op(f"h{i}.proj", "forward", 2 * tokens * d * d, (ctx, p["proj"], x), (h,), attn)
        if dropout:
            h, m_attn = drop(i, "attn", h)
        u = tensor(4 * act, "activation", f"h{i}.fc")
        op(f"h{i}.fc", "forward", 8 * tokens * d * d, (h, p["fc"]), (u,), mlp)
        nxt = tensor(act, "activation", f"x{i + 1}")
        op(f"h{i}.out", "forward", 8 * tokens * d * d, (u, p["out"], h), (nxt,), mlp)
        if dropout:
            nxt, m_mlp = drop(i, "mlp", nxt)
            masks.append((m_attn, m_mlp))
        saved.append((x, qkv, ctx, h, u))
        x = nxt
    logits = tensor(tokens * vocab * dtype_bytes, "temporary", "logits")
    op("lm_head+loss", "forward", 2 * tokens * d * vocab, (x, emb), (logits,), "lm_head")

    # backward, in reverse; weight gradients are born here and die at the optimizer
    grads: dict[int, int] = {}
    dx = tensor(act, "activation", f"dx{layers}")
    g_emb = tensor(tensors[emb].bytes, "gradient", "wte.grad")
    grads[emb] = g_emb
    op("lm_head.backward", "backward", 4 * tokens * d * vocab, (logits, x, emb), (dx, g_emb), "lm_head")
    for i in reversed(range(layers)):
        p = params[i]
        attn, mlp = f"blocks.{i}.attn", f"blocks.{i}.mlp"
        xi, qkv, ctx, h, u = saved[i]
        g = {k: tensor(tensors[w].bytes, "gradient", f"h{i}.{k}.grad") for k, w in p.items()}
        grads.update({p[k]: g[k] for k in p})
        if dropout:
            dy = tensor(act, "activation", f"h{i}.mlp.ddrop")
            op(f"h{i}.mlp.dropout.backward", "backward", 0, (dx, masks[i][1]), (dy,), mlp)
            dx = dy
        du = tensor(4 * act, "activation", f"h{i}.dfc")
        op(f"h{i}.out.backward", "backward", 16 * tokens * d * d, (dx, u, p["out"]), (du, g["out"]), mlp)
        dh = tensor(act, "activation", f"h{i}.dh")
        op(f"h{i}.fc.backward", "backward", 16 * tokens * d * d, (du, h, p["fc"], dx), (dh, g["fc"]), mlp)
        if dropout:
            dy = tensor(act, "activation", f"h{i}.attn.ddrop")
            op(f"h{i}.attn.dropout.backward", "backward", 0, (dh, masks[i][0]), (dy,), attn)
            dh = dy
        dctx = tensor(act, "activation", f"h{i}.dctx")
        op(f"h{i}.proj.backward", "backward", 4 * tokens * d * d, (dh, ctx, p["proj"]), (dctx, g["proj"]), attn)
        dqkv = tensor(3 * act, "activation", f"h{i}.dqkv")
        op(f"h{i}.attn.backward", "backward", 8 * tokens * seq * d, (dctx, qkv), (dqkv,), attn)
        dxi = tensor(act, "activation", f"dx{i}")
        op(f"h{i}.qkv.backward", "backward", 12 * tokens * d * d, (dqkv, xi, p["qkv"], dh), (dxi, g["qkv"]), attn)
        dx = dxi
    op("embedding.backward", "backward", 0, (dx, ids, g_emb), (g_emb,), "wte")

    # AdamW: two fp32 moments per parameter, updated in place
    for w, gw in grads.items():
        n_elems = tensors[w].bytes // dtype_bytes
        m = tensor(n_elems * 4, "optimizer_state", f"{tensors[w].name}.exp_avg", True)
        v = tensor(n_elems * 4, "optimizer_state", f"{tensors[w].name}.exp_avg_sq", True)
        op(f"adamw.{tensors[w].name}", "optimizer", 12 * n_elems, (w, gw, m, v), (w, m, v), None, pure=False)
    return Trace(
        ops,
        tensors,
        name=f"gpt-L{layers}-d{d_model}-b{batch}x{seq}" + ("-dropout" if dropout else ""),
        meta={"source": "synthetic", "hardware": hardware.name, "dtype_bytes": dtype_bytes},
    )


def training_trace(layers: int, sizes_mb: list[int], durations_ms: list[int], name: str = "random-training") -> Trace:
    """A small training-shaped trace with every size and time given: a forward pass
    that saves activations, a backward pass that reads them in reverse with the
    weights, and an optimizer step that updates the weights. The robustness property
    test and ``benchmarks/robustness.py`` draw these at random.

    Args:
        layers: number of weight layers.
        sizes_mb: ``4 * layers + 2`` sizes in MB (10^6 bytes), in creation order: the
            ``layers`` weights, the input, one activation per layer, the loss
            gradient, then a (weight gradient, input gradient) pair per layer from the
            last.
        durations_ms: ``3 * layers + 2`` op times in ms, in op order.

    Raises:
        ValueError: if a list has the wrong length.
    """
    if len(sizes_mb) != 4 * layers + 2 or len(durations_ms) != 3 * layers + 2:
        raise ValueError(
            f"training_trace({layers} layers) needs {4 * layers + 2} sizes and {3 * layers + 2} "
            f"durations, got {len(sizes_mb)} and {len(durations_ms)}"
        )
    sizes = iter(sizes_mb)
    durations = iter(durations_ms)
    tensors: list[TensorInfo] = []
    ops: list[Op] = []

    def tensor(kind: str, persistent: bool = False) -> int:
        tensors.append(TensorInfo(len(tensors), next(sizes) * MB, kind, persistent))
        return len(tensors) - 1

    def dur() -> float:
        return next(durations) * 1e-3

    weights = [tensor("parameter", True) for _ in range(layers)]
    x = tensor("input")
    saved = []
    for i, w in enumerate(weights):
        y = tensor("activation")
        ops.append(Op("fwd", "forward", dur(), (x, w), (y,), scope=f"layers.{i}"))
        saved.append(x)
        x = y
    dy = tensor("activation")
    ops.append(Op("loss", "forward", dur(), (x,), (dy,)))
    grads = []
    for i in reversed(range(layers)):
        w, a = weights[i], saved[i]
        g = tensor("gradient")
        dx = tensor("activation")
        ops.append(Op("bwd", "backward", dur(), (dy, a, w), (g, dx), scope=f"layers.{i}"))
        grads.append((w, g))
        dy = dx
    ops.append(Op("bwd_end", "backward", dur(), (dy,), ()))
    for w, g in grads:
        ops.append(Op("step", "optimizer", dur(), (w, g), (w,), pure=False))
    return Trace(ops, tensors, name)


def toy_hardware(pcie_gbps: float = 10.0, host_gib: float = 64, fault_us: float = 0.0) -> Hardware:
    """A 1 GiB ``gpu`` with host memory and an SSD: ``rtx4090-24g``'s tiers and links,
    every link at ``pcie_gbps`` GB/s with no latency, the SSD without access latency,
    and ``fault_us`` per demand fault. Small enough that small traces need planning."""
    hw = load_hardware("rtx4090-24g")
    links = tuple(dataclasses.replace(link, bandwidth=pcie_gbps * 1e9, latency_s=0.0) for link in hw.links)
    hw = dataclasses.replace(hw, links=links, fault_latency_s=fault_us * 1e-6, name="test-hw")
    hw = hw.with_tier("gpu", capacity=float(2**30))
    hw = hw.with_tier("host", capacity=float(host_gib * 2**30))
    return hw.with_tier("ssd", latency_s=0.0)


UPGRADES = ("links", "host-links", "ssd-links", "host-memory")


def upgraded(hw: Hardware, kind: str, factor: float) -> Hardware:
    """``hw`` with one resource ``factor`` times larger: ``links`` (every link and bus),
    ``host-links`` or ``ssd-links`` (those touching that tier, and their buses) or
    ``host-memory`` (the host's capacity). The machine upgrades of the robustness
    property (a better machine must never give a slower step).

    Raises:
        ValueError: for another ``kind``.
    """
    if kind == "links":
        return hw.scaled_links(factor)
    if kind in ("host-links", "ssd-links"):
        return hw.scaled_links(factor, kind.split("-")[0])
    if kind == "host-memory":
        return hw.with_tier("host", capacity=hw.tier("host").capacity * factor)
    raise ValueError(f"unknown upgrade {kind!r}: one of {', '.join(UPGRADES)}")
