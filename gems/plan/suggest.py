"""The smallest change that makes a plan fit: same ranks first (checkpointing, bf16, micro-batches), then
more spatial parts or pipeline stages, each tried with a quick plan.
"""
from __future__ import annotations

from typing import Any

from gems.config import typed
from gems.errors import ConfigError, RunError
from gems.plan.memory import Setup, plan_memory


def variant(cfg: Any, overrides: dict[str, Any]) -> Any:
    """The quick plan (gems.plan.memory.plan_memory) of ``cfg`` with ``overrides``, placed like any run where it
    takes more ranks; None where the model cannot take the change (a part its layers refuse)."""
    from omegaconf import OmegaConf, open_dict

    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(c, False)
    with open_dict(c):
        for k, v in overrides.items():
            OmegaConf.update(c, k, v, merge=False)
        if c.cluster.launcher == "slurm" or c.cluster.name != "local":  # more ranks: placed like any run
            from gems.config import place
            from gems.mesh import mesh_from_config

            c.cluster.nodes = c.cluster.tasks_per_node = None
            c.cluster.nodes, c.cluster.tasks_per_node = place(c.cluster, mesh_from_config(c).size)
    try:
        return plan_memory(typed(c), quick=True)[0]
    except (ConfigError, RunError):
        return None


def _fits(cfg: Any, overrides: dict[str, Any]) -> bool:
    plan = variant(cfg, overrides)
    return plan is not None and bool(plan.fits)


def recompute_note(cfg: Any, plan: Any) -> str | None:
    """Where ``parallel.checkpoint=true`` plans no less memory than the same run without it, a note that says so
    (CosmoFlow: its first layers' activations and their gradients set the peak whichever way it is cut)."""
    if not plan.checkpoint:
        return None
    # two quick plans, on the same footing (the full one traces every spatial part at two batches), both eager: a
    # recomputed step runs eager, and without recomputation the graphs' static input would be counted against it
    on, off = variant(cfg, {}), variant(cfg, {"parallel.checkpoint": False, "train.cuda_graphs": False})
    if on is None or off is None:
        return None
    on_b, off_b = on.worst.bytes.total, off.worst.bytes.total
    if off_b > on_b:
        return None
    return (f"parallel.checkpoint=true saves no memory here: {on_b / 2**30:.2f} GiB a rank with it, "
            f"{off_b / 2**30:.2f} without (the largest activations and their gradients are alive together whichever "
            f"way the model is cut), and recomputation costs a forward a step")


def suggest_change(cfg: Any, st: Setup) -> str | None:
    """The smallest change that fits, tried in order: same ranks first, then more ranks."""
    cands: list[tuple[str, dict[str, Any]]] = []
    if not st.checkpoint:
        cands.append(("parallel.checkpoint=true", {"parallel.checkpoint": True}))
    if st.precision == "fp32":
        cands.append(("train.precision=bf16", {"train.precision": "bf16"}))
    if st.settings.pipelined and not st.kind.keeps_all_in_flight:  # more micro-batches: smaller ones in flight
        line = st.batch // st.replicas // st.eta
        for m in range(st.m + 1, line + 1):
            if line % m == 0:
                cands.append((f"parallel.micro_batches={m}", {"parallel.micro_batches": m}))
                break
    # more spatial parts along the cut dims
    parts = list(st.mesh.parts)
    extent = [st.spec.input_shape[1 + d] for d in st.mesh.spatial_dims] if st.spec.spatial_ndim else []
    for mult in (2, 4, 8, 16):
        k = min(range(len(parts)), key=lambda i: parts[i])
        new = list(parts)
        new[k] *= mult
        if extent and new[k] > extent[k]:
            break
        val = new[0] if len(new) == 1 else new
        txt = f"parallel.spatial={val if len(new) == 1 else '[' + ','.join(map(str, new)) + ']'}"
        cands.append((txt, {"parallel.spatial": val}))
        cands.append((txt + " parallel.checkpoint=true", {"parallel.spatial": val, "parallel.checkpoint": True}))
    n_layers = len(st.spec.module)
    if st.mesh.pipeline * 2 <= n_layers:
        sched = st.schedule if st.kind.overlaps else "1f1b"  # (lp's stages take turns: no overlap to keep)
        cands.append((f"parallel.pipeline={st.mesh.pipeline * 2} parallel.schedule={sched}",
                      {"parallel.pipeline": st.mesh.pipeline * 2, "parallel.schedule": sched, "parallel.balance": None}))
    for text, ov in cands:
        if _fits(cfg, ov):
            return text
    return None
