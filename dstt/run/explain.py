"""Why a loss spiked: ``run.explain(spike)`` gathers what each mechanism check of
:mod:`dstt.analysis.mechanisms` needs, runs them all and ranks what they found.

Each check reads only what it needs, through the run's lazy views, and records what it read
(``Finding.read``): the logged loss and the summaries' NaN/Inf counts and update ratios of the
look-back window, the query/key weights at a few commits, ``exp_avg_sq`` at the last few
commits, per-sample losses from ``run.replay`` when replay objects are given. Rejected
alternative: reading a whole snapshot per step of the window — the stored-state checks of a
10,000-step run answer in well under a second because they read a few tensors of a few
commits and the index's rows, not the run. What each check reads: docs/decisions.md.
"""

from __future__ import annotations

import functools
import html
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt import schema
from dstt.analysis.mechanisms import (
    LIKELY,
    UNKNOWN,
    Finding,
    adam_second_moment,
    attention_logit_growth,
    bad_data,
    g2_from_v,
    logit_bound,
    numerics,
    rank,
    update_too_large,
)
from dstt.errors import ConfigError, DsttError, StepNotFoundError
from dstt.inspect.html import html_rows
from dstt.inspect.summaries import Spike, spike_cause

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["ADAM_STEPS", "LOGIT_POINTS", "LOOKBACK", "Explanation", "explain_spike"]

LOOKBACK = 20  #: commits up to the cause that the stored-state checks look at
LOGIT_POINTS = 8  #: commits of that window whose query/key weights are read
ADAM_STEPS = 12  #: consecutive commits up to the cause whose g²/v is computed
SCALE_METRICS = ("loss_scale", "grad_scale", "scale")
FUSED = ("qkv", "c_attn", "Wqkv", "query_key_value", "in_proj")
CONFIG_HEADS = ("num_attention_heads", "n_head", "num_heads")  #: a HF config's head count
PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("wq", "wk"), ("to_q", "to_k"), ("q", "k"))


@dataclass(frozen=True)
class Explanation:
    """The mechanisms checked for one spike, ranked (:func:`dstt.analysis.mechanisms.rank`):
    ``findings[0]`` is what to look at first. ``step`` is the spike's first flagged step,
    ``cause``/``parent`` the committed update that produced it; ``seconds`` the time taken."""

    step: int
    cause: int | None
    parent: int | None
    findings: list[Finding]
    timeline: str
    seconds: float = 0.0
    replayed: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def top(self) -> Finding:
        return self.findings[0]

    @property
    def likely(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict == LIKELY]

    def finding(self, mechanism: str) -> Finding:
        for f in self.findings:
            if f.mechanism == mechanism:
                return f
        raise ConfigError(
            f"no finding for {mechanism!r}; checked: {[f.mechanism for f in self.findings]}"
        )

    def __str__(self) -> str:
        where = (
            f"update {self.parent} -> {self.cause}"
            if self.parent is not None
            else f"update into {self.cause}"
        )
        lines = [f"spike at step {self.step} ({where}, timeline {self.timeline!r}):"]
        for i, f in enumerate(self.findings, 1):
            lines.append(f"  {i}. {f}")
            if f.hint:
                lines.append(f"     hint: {f.hint}")
        if not self.replayed:
            lines.append("  (no replay objects: checks that need replay are unknown)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Explanation\n{self}\n>"

    def _repr_html_(self) -> str:
        rows = html_rows(
            (
                f.mechanism,
                f.verdict,
                "" if not np.isfinite(f.score) else f"{f.score:.3g}",
                (f.missing if f.verdict == UNKNOWN else ", ".join(map(str, f.points_at[:5]))) or "",
                f.hint,
            )
            for f in self.findings
        )
        head = "".join(
            f"<th>{h}</th>" for h in ("mechanism", "verdict", "score", "points at", "hint")
        )
        return (
            f"<div><b>Spike at step {self.step}</b> (update {self.parent} &rarr; {self.cause},"
            f" timeline {html.escape(self.timeline)})<table><tr>{head}</tr>{rows}</table></div>"
        )


def _pick(run: Any, spike: Spike | int | None, metric: str, timeline: str) -> int:
    """The first flagged step of ``spike``: the largest spike when None, else the first
    non-finite ``metric`` value."""
    if isinstance(spike, Spike):
        return int(spike.first_step)
    if spike is not None:
        if isinstance(spike, bool) or not isinstance(spike, (int, np.integer)):
            raise ConfigError(f"spike must be a Spike, a step (int) or None, got {spike!r}")
        return int(spike)
    found = run.spikes(metric, top=0, timeline=timeline)
    if found:
        best = max(found, key=lambda s: s.zscore)
        return int(best.first_step)
    ds = run.metrics(timeline)
    if metric in ds.names:
        bad = np.flatnonzero(~np.isfinite(ds.column(metric).astype(np.float64)))
        if bad.size:
            return int(ds.steps[bad[0]])
    raise StepNotFoundError(
        f"timeline {timeline!r} has no spike of {metric!r} and no non-finite value: "
        "pass the step to explain, run.explain(k)"
    )


def explain_spike(
    run: Any,
    spike: Spike | int | None = None,
    *,
    replay: Mapping[str, Any] | None = None,
    metric: str = "loss",
    lookback: int = LOOKBACK,
    heads: int | None = None,
    timeline: str | None = None,
) -> Explanation:
    """Check every mechanism for ``spike`` (a ``Spike``, its first step, or None: the
    largest) of ``run`` and rank them; ``replay`` (keyword arguments of ``run.replay``:
    ``model``, ``optimizer``, ``dataset``, ``loss_fn``, ... or ``trainer``) enables the
    checks that recompute; ``heads`` the attention heads per layer (None: as the session
    recorded them, ``model/heads`` or a Hugging Face config; else each projection as one
    head, said in the finding's ``evidence["heads_from"]``)."""
    t0 = time.perf_counter()
    if isinstance(lookback, bool) or not isinstance(lookback, int) or lookback < 4:
        raise ConfigError(f"lookback must be an int >= 4 (commits), got {lookback!r}")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ConfigError(f"heads must be a positive int or None, got {heads!r}")
    if replay is not None and not hasattr(replay, "keys"):
        raise ConfigError(
            "replay takes run.replay's keyword arguments as a dict: "
            "replay=dict(model=..., optimizer=..., dataset=..., loss_fn=...)"
        )
    name = timeline or run.timeline
    if isinstance(spike, Spike) and spike.timeline:
        name = spike.timeline
    start = _pick(run, spike, metric, name)
    line = run.commits(name)
    steps = [int(h.step) for h in line]
    parent, cause = spike_cause(steps, start)
    if cause is None:
        raise StepNotFoundError(
            f"step {start} was computed on weights from before the first commit of "
            f"timeline {name!r}: nothing stored explains it"
        )
    i = steps.index(cause)
    window = steps[max(0, i - lookback) : i + 1]
    ctx = _Context(run, name, start, cause, window, replay, heads)
    findings = [
        ctx.numerics(metric),
        ctx.update_too_large(),
        ctx.attention(),
        ctx.adam(),
        ctx.bad_data(),
    ]
    return Explanation(
        start,
        cause,
        parent,
        rank(findings),
        name,
        seconds=time.perf_counter() - t0,
        replayed=replay is not None,
    )


def _with_read(f: Finding, read: Sequence[str]) -> Finding:
    return replace(f, read=tuple(read))


def _span(steps: Sequence[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])


@dataclass
class _Context:
    """What the checks of one spike share: the run, the window, the summaries (read once)."""

    run: Any
    timeline: str
    start: int
    cause: int
    window: list[int]
    replay: Mapping[str, Any] | None
    heads: int | None

    @functools.cached_property
    def sums(self) -> Any:
        return self.run.summaries(self.window, timeline=self.timeline)

    @functools.cached_property
    def names(self) -> list[str]:
        if self.sums.sizes.get("tensor", 0) == 0:
            return []
        return [str(n) for n in self.sums["tensor"].values]

    # -- checks ---------------------------------------------------------------------------
    def numerics(self, metric: str) -> Finding:
        ds = self.run.metrics(self.timeline)
        lo = self.window[0]
        loss = scale = None
        read = []
        st = np.asarray(ds.steps)
        keep = (st >= lo) & (st <= self.start)
        if metric in ds.names:
            loss = ds.column(metric).astype(np.float64)[keep]
            read.append(f"metric {metric!r} at steps {lo}..{self.start}")
        for s in SCALE_METRICS:
            if s in ds.names:
                scale = ds.column(s).astype(np.float64)[keep]
                read.append(f"metric {s!r} at steps {lo}..{self.start}")
                break
        names, sums = self.names, self.sums
        nonfinite = None
        wst = st[keep]
        if names:
            counts = sums["nan"].values + sums["inf"].values  # step x tensor, window only
            by = {int(s): j for j, s in enumerate(sums["step"].values)}
            nonfinite = np.zeros((len(wst), len(names)))
            for r, s in enumerate(wst):
                if int(s) in by:
                    nonfinite[r] = counts[by[int(s)]]
            read.append(f"summaries' nan/inf of {len(names)} tensors at steps {_span(self.window)}")
        return _with_read(numerics(wst, loss, nonfinite, names, loss_scale=scale), read)

    def update_too_large(self) -> Finding:
        if not self.names:
            return update_too_large(None, [])
        sums = self.sums
        f = update_too_large(sums["update_ratio"].values, self.names, steps=sums["step"].values)
        return _with_read(f, [f"summaries' update_ratio at steps {_span(self.window)}"])

    def attention(self) -> Finding:
        pairs = _qk_pairs(self.names)
        if not pairs:
            return attention_logit_growth(None, [], [])
        upto = self.window[:-1] or self.window  # growth before the bad update
        n = min(LOGIT_POINTS, len(upto))
        pick = sorted({upto[round(float(j))] for j in np.linspace(0, len(upto) - 1, n)})
        layers = list(pairs)
        bounds = np.full((len(pick), len(layers)), np.nan)
        read: set[str] = set()
        stored, config = self._head_facts()
        heads: dict[str, int | None] = {}
        heads_from: dict[str, str] = {}
        for r, s in enumerate(pick):
            snap = self.run.at(s, self.timeline)
            for c, layer in enumerate(layers):
                q_name, k_name = pairs[layer]
                try:
                    wq = snap.to_numpy(q_name).astype(np.float64)
                    wk = wq if k_name == q_name else snap.to_numpy(k_name).astype(np.float64)
                except DsttError:
                    continue
                read.update((q_name, k_name))
                if k_name == q_name:  # fused: rows q | k | v
                    d = wq.shape[1]
                    if wq.shape[0] != 3 * d:
                        continue
                    wq, wk = wq[:d], wq[d : 2 * d]
                if not (np.isfinite(wq).all() and np.isfinite(wk).all()):
                    continue
                if layer not in heads:
                    got = _heads_of(layer, wq.shape[0], self.heads, stored, config)
                    heads[layer], heads_from[layer] = got
                try:
                    bounds[r, c] = logit_bound(wq, wk, heads[layer] or 1)
                except ConfigError as e:
                    heads[layer] = None
                    heads_from[layer] = f"unknown: {e}; the projection taken as one head"
                    bounds[r, c] = logit_bound(wq, wk, 1)
        f = attention_logit_growth(bounds, layers, pick)
        if f.verdict != UNKNOWN:
            f.evidence.update(heads=heads, heads_from=heads_from)
        reads = [f"weights {', '.join(sorted(read))} at steps {pick}"]
        facts = {schema.HEADS_OBJECT: stored, schema.CONFIG_OBJECT: config}  # empty with heads=
        if what := [o for o, v in facts.items() if v]:
            reads.append(f"{' and '.join(what)} at step {self.cause}")
        return _with_read(f, reads)

    def _head_facts(self) -> tuple[dict[str, Any], int | None]:
        """The run's head counts: ``model/heads`` (by module path) and a Hugging Face
        config's ``num_attention_heads`` (or ``n_head``, ``num_heads``), as the cause stores
        them; nothing read when ``heads=`` was given."""
        if self.heads is not None:
            return {}, None
        snap = self.run.at(self.cause, self.timeline)
        have = list(snap.objects)
        stored: dict[str, Any] = {}
        config: int | None = None
        for obj in have:
            if obj == schema.HEADS_OBJECT or obj.startswith(schema.HEADS_OBJECT + "/"):
                try:
                    got = snap.object(obj)
                except DsttError:
                    continue
                if isinstance(got, dict):
                    stored = got
                    break
        if schema.CONFIG_OBJECT in have:
            try:
                cfg = snap.object(schema.CONFIG_OBJECT)
            except DsttError:
                cfg = None
            for key in CONFIG_HEADS:
                n = cfg.get(key) if isinstance(cfg, dict) else None
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    config = n
                    break
        return stored, config

    def adam(self) -> Finding:
        names = self.names
        run, tl = self.run, self.timeline
        if not names:
            return adam_second_moment(None, [], [])
        w = self.window
        consecutive = [w[-1]]
        for s in reversed(w[:-1]):
            if consecutive[0] - s != 1 or len(consecutive) > ADAM_STEPS:
                break
            consecutive.insert(0, s)
        snap = run.at(self.cause, tl)
        betas = _beta2(snap)
        if not betas:
            return _with_read(
                adam_second_moment(None, names, []), ["optim/param_groups (no Adam betas)"]
            )
        use = [n for n in names if n in betas]
        grads: dict[str, float] = {}
        source = "stored exp_avg_sq recurrence (v_t - b2 v_t-1) / (1 - b2)"
        read = [f"optim/param_groups at step {self.cause}"]
        if self.replay is not None:
            r = run.replay(self.cause, **dict(self.replay), per_sample=False, timeline=tl)
            for n in use:
                try:
                    g = r.grad(n).detach().double().numpy()
                except DsttError:
                    continue
                grads[n] = float(np.mean(g**2))
            source = f"replay of step {self.cause} (earlier steps: stored exp_avg_sq)"
            read.append(f"replay of step {self.cause}: gradients")
        if len(consecutive) < 2 and not grads:
            missing = "consecutive commits (g² needs v of two steps in a row) or replay"
            return Finding(
                "adam_second_moment", UNKNOWN, float("nan"), {"missing": missing}, read=tuple(read)
            )
        vs: dict[int, dict[str, np.ndarray]] = {}
        for s in consecutive:
            sn = run.at(s, tl)
            vs[s] = {}
            for n in use:
                try:
                    vs[s][n] = sn.to_numpy(n, state="exp_avg_sq").astype(np.float64)
                except DsttError:
                    continue
        if not any(vs.values()):
            return _with_read(adam_second_moment(None, use, []), read)
        read.append(f"exp_avg_sq of {len(use)} tensors at steps {_span(consecutive)}")
        counts = self._step_counts(use)
        read.append(f"optim step counts of {len(counts)} tensors at step {self.cause}")
        rows = consecutive[1:]
        rho = np.full((len(rows), len(use)), np.nan)
        for r, s in enumerate(rows):
            for c, n in enumerate(use):
                prev, now = vs[s - 1].get(n), vs[s].get(n)
                if prev is None or now is None:
                    continue
                t = counts.get(n, float(s - 1)) - (self.cause - (s - 1))  # v_{s-1}'s count
                b2 = betas[n]
                # bias-corrected: raw v of step t is (1 - b2^t) of its average
                denom = float(np.mean(prev)) / (1.0 - b2 ** max(t, 1.0))
                if not denom > 0:
                    continue
                g2 = grads[n] if s == self.cause and n in grads else g2_from_v(prev, now, b2)
                rho[r, c] = float(np.mean(g2)) / denom
        return _with_read(adam_second_moment(rho, use, rows, source=source), read)

    def _step_counts(self, names: Sequence[str]) -> dict[str, float]:
        """The optimizer's step count per tensor at the cause (``optim/step``)."""
        snap = self.run.at(self.cause, self.timeline)
        out: dict[str, float] = {}
        for n in names:
            try:
                out[n] = float(np.asarray(snap.to_numpy(n, state="step")).ravel()[0])
            except (DsttError, IndexError):
                continue
        return out

    def bad_data(self) -> Finding:
        if self.replay is None:
            return bad_data(None)
        r = self.run.replay(self.start, **dict(self.replay), timeline=self.timeline)
        ps = r.per_sample
        f = bad_data(ps["loss"].values, ps["index"].values)
        return _with_read(f, [f"replay of step {self.start}: per-sample losses"])


def _beta2(snap: Any) -> dict[str, float]:
    """β₂ per parameter name from the stored ``param_groups`` (empty: not Adam-like)."""
    out: dict[str, float] = {}
    for obj in [o for o in snap.objects if o.startswith(schema.OPTIM_GROUPS_OBJECT)]:
        try:
            groups = snap.object(obj)
        except DsttError:
            continue
        for g in groups if isinstance(groups, list) else []:
            betas = g.get("betas") if isinstance(g, dict) else None
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                continue
            for p in g.get("params", []):
                if isinstance(p, str):
                    out[p] = float(betas[1])
    return out


def _heads_of(
    layer: str,
    rows: int,
    given: int | None,
    stored: Mapping[str, Any],
    config: int | None,
) -> tuple[int | None, str]:
    """The head count of ``layer`` (a module path; ``rows``: its query projection's) and
    where it came from: ``heads=``, else ``model/heads`` of the layer or its nearest
    ancestor (a ``head_dim`` divides ``rows``), else the model config; None: unknown."""
    if given is not None:
        return given, "heads="
    parts = layer.split(".") if layer else []
    for i in range(len(parts), -1, -1):
        path = ".".join(parts[:i])
        facts = stored.get(path)
        if not isinstance(facts, dict):
            continue
        where = f"{schema.HEADS_OBJECT} of {path or 'the model'!s}"
        n, dh = facts.get("heads"), facts.get("head_dim")
        if isinstance(n, int) and n > 0:
            return n, where
        if isinstance(dh, int) and dh > 0 and rows % dh == 0:
            return rows // dh, f"{where} (head_dim {dh})"
    if config is not None:
        return config, schema.CONFIG_OBJECT
    return None, "unknown: each projection taken as one head (pass heads=)"


def _qk_pairs(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """``{layer: (query weight, key weight)}`` recognised by name; a fused projection is
    its own pair (rows q | k | v)."""
    have = set(names)
    out: dict[str, tuple[str, str]] = {}
    for n in names:
        if not n.endswith(".weight"):
            continue
        mod = n[: -len(".weight")]
        prefix, _, leaf = mod.rpartition(".")
        if leaf in FUSED:
            out[prefix or mod] = (n, n)
            continue
        for q, k in PAIRS:
            if leaf == q and f"{prefix}.{k}.weight" in have:
                out[prefix or mod] = (n, f"{prefix}.{k}.weight")
    return out
