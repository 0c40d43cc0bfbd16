"""``dstt replay``: re-execute a past step from a user's script and print what it found.

``dstt replay --step K --script train.py:make`` imports ``train.py`` (as a file, without
running its ``__main__`` block) and calls ``make()``, which returns what a replay needs, as a
dict: ``model`` and ``optimizer`` (required: built as the training script builds them),
``scheduler``, ``dataset`` (and ``collate``), or ``batches``, and ``loss_fn``. Then
``run.replay(K, ...)`` (:mod:`dstt.inspect.replay`) and a report: whether the replay was
faithful, the tensors with the largest gradient norms, the samples with the largest losses.
Rejected alternative: a replay command taking model and data options — a model and its data
pipeline are code, and the user's own script already builds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .common import UsageError, _emit, _fields, _fmt, _resolve_run

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator

__all__ = ["cmd_replay", "load_factory"]

_KEYS = ("model", "optimizer", "scheduler", "dataset", "collate", "batches", "loss_fn")


def load_factory(spec: str) -> Any:
    """``path/to/file.py:function`` -> the function, loaded as ``dstt.open(run,
    replay=...)`` loads it (:func:`dstt.inspect.rebuild.load_factory`); a bad spec exits 2."""
    from dstt.errors import ConfigError
    from dstt.inspect.rebuild import load_factory as load

    try:
        return load(spec)
    except ConfigError as e:
        raise UsageError(f"--script: {e}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    made = load_factory(args.script)()
    if not isinstance(made, dict) or "model" not in made or "optimizer" not in made:
        raise UsageError(
            f"--script {args.script}: the function must return a dict with "
            f"'model' and 'optimizer' (and any of {', '.join(_KEYS[2:])})"
        )
    unknown = sorted(set(made) - set(_KEYS))
    if unknown:
        raise UsageError(
            f"--script {args.script}: unknown keys {unknown}; expected {', '.join(_KEYS)}"
        )
    r = run.replay(
        args.step,
        made["model"],
        made["optimizer"],
        **{k: made[k] for k in _KEYS[2:] if k in made},
        per_sample_grads=args.sample_grads,
        timeline=args.timeline,
    )
    top = r.top(args.top)
    samples = r.per_sample.isel(sample=slice(0, args.top))
    doc = {
        **_fields(r, "step faithful max_abs_diff differs losses"),
        "top_grad_norm": [{"tensor": n, "grad_norm": v} for n, v in top],
        "worst_samples": [
            {"index": int(i), "loss": float(v), "micro_batch": int(m)}
            for i, v, m in zip(
                samples["index"].values,
                samples["loss"].values,
                samples["micro_batch"].values,
                strict=True,
            )
        ],
    }

    def text() -> Iterator[str]:
        verdict = (
            "faithful: the replayed update equals the commit bit for bit"
            if r.faithful
            else f"NOT faithful: {len(r.differs)} tensors differ, max |diff| {_fmt(r.max_abs_diff)}"
        )
        yield f"step {r.step}: {verdict}"
        yield f"micro-batch losses: {', '.join(_fmt(x) for x in r.losses)}"
        yield "largest gradient norms:"
        for n, v in top:
            yield f"  {_fmt(v, '.4e'):>12}  {n}"
        yield "largest sample losses (each sample alone, weights of the step before):"
        for d in doc["worst_samples"]:
            yield f"  {_fmt(d['loss']):>10}  sample {d['index']}  (micro-batch {d['micro_batch']})"

    return _emit(args, doc, text)
