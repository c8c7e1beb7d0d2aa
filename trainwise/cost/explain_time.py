"""`trainwise plan --explain`, section 4 when the step-time model priced the step: the formula, the
per-operator table, the phases, the largest contributors and the communication terms."""

from __future__ import annotations

from trainwise.cost.steptime import COMPILED_ELEMENTWISE

SOURCES = {"calibrated": "calibrated on this machine (`trainwise hardware --calibrate`)",
           "table defaults": "from table, uncalibrated: datasheet peaks x default efficiencies "
                             "(cost.steptime.DEFAULT_EFFICIENCY)"}


def explain_step(p) -> str:
    st, out = p.step, []
    add = out.append
    add(f"4. Time per step = sum over the step's operators + eager overhead + exposed communication "
        f"({SOURCES.get(st.source, st.source)})")
    add("   matmul and attention: timed at their shape and layout on this device (else F/P + Q/BW, F/R); other "
        "ops: Q/BW(q) of their class at their bytes per call q" + (f"; x{p.hardware.profile.in_step:.3g}, what "
        "kernels lose inside a real step" if p.hardware.profile and p.hardware.profile.in_step != 1 else "")
        + (f"; compiled: fused element-wise work at {COMPILED_ELEMENTWISE.get(p.recipe.compute_dtype, 1.0)} x its "
           "eager time" if st.compiled else ""))
    add("   (a matmul's shape: M x K x N, or batch x M x K x N, and its operands' layout, N row-major or T "
        "transposed; attention: batch x heads x kv heads x T x head dim)")
    add(f"   {'operator':<56} {'phase':<9} {'dtype':<5} {'calls':>6} {'FLOPs':>10} {'bytes':>10} {'time s':>10}  rule")
    rows = sorted(st.ops, key=lambda t: -t.seconds)
    for t in rows[:25]:
        o = t.op
        shape = (f" {'x'.join(map(str, o.shape[1:] if o.cls == 'matmul' and o.shape[0] == 1 else o.shape))} {o.layout}"
                 if o.shape else "")
        add(f"   {(o.name.removeprefix('aten.') + shape)[:56]:<56} {o.phase:<9} {o.dtype:<5} {o.calls:>6} "
            f"{o.flops:>10.3g} {o.bytes:>10.3g} {t.seconds:>10.4g}  {t.how}")
    if len(rows) > 25:
        add(f"   ... {len(rows) - 25} more operators, {sum(t.seconds for t in rows[25:]):.4g} s together")
    phases = st.by_phase()
    add("   per phase: " + ", ".join(f"{k} {v:.4g} s" for k, v in phases.items())
        + (" (backward includes the recompute of checkpointing)" if p.checkpointing != "none" else ""))
    top = st.top(3)
    share = ", ".join(f"{t.op.name.removeprefix('aten.')} ({t.op.phase}) {t.seconds / st.seconds:.0%}" for t in top)
    add(f"   largest contributors: {share}")
    add(f"   operators {st.compute_s:.4g} s + eager overhead {st.overhead_s:.4g} s + communication "
        f"{st.comm_s:.4g} s exposed" + (f" (of {sum(st.comm.values()):.4g} s: "
                                        + ", ".join(f"{k} {v:.4g} s" for k, v in st.comm.items()) + ")" if st.comm else "")
        + f" = {st.seconds:.4g} s per step")
    tps = p.tokens_per_step / st.seconds
    add(f"   tokens/s = {p.tokens_per_step:,} tokens per step / {st.seconds:.4g} s = {tps:,.0f}; "
        f"MFU = {p.model_flops_per_token:.4g} x {tps:,.0f} / ({p.gpus} x {p.hardware.peak_flops:.4g}) = {p.mfu:.2%}")
    add(f"   time = D / tokens/s = {p.tokens:.4g} / {tps:,.0f} = {p.time.seconds:.4g} s = {p.time.days:.2f} days "
        f"= {p.time.device_hours:,.1f} device-hours")
    return "\n".join(out)
