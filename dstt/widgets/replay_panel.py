"""One click from a spike to its replay: the scrubber's replay panel.

``scrubber(run, replay=...)`` adds a button under the views; a click re-executes the step (or
spike) under the cursor from the commit before it (:meth:`dstt.Run.replay`) and shows the
tensors with the largest gradient norms, the worst samples of the batch, whether the replay
was faithful and, for a spike, :meth:`dstt.Run.explain`'s ranked mechanisms. ``replay`` is
:meth:`dstt.Run.replay`'s keyword arguments, or a callable taking the step and returning a
:class:`~dstt.inspect.replay.Replay`. Errors show in the status line and stay in ``.error``.
Rejected alternative: replaying every spike when the widget opens — each costs a training
step, for spikes nobody looks at. Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt._optional import require
from dstt.plots.draw import draw_bars

from .views import FigureView

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.axes import Axes

    from dstt.inspect.replay import Replay
    from dstt.inspect.summaries import Spike
    from dstt.run.explain import Explanation

    from .model import ScrubberModel

__all__ = ["ReplayPanel", "ReplayWith"]

#: how a scrubber replays a step: :meth:`dstt.Run.replay`'s keyword arguments, or a callable
#: from the step (or its ``Spike``) to a ``Replay``
ReplayWith = Mapping[str, Any] | Callable[["int | Spike"], "Replay"]


class ReplayPanel:
    """The replay button, its status line, the gradient-norm bars and the worst-samples table
    of a scrubber (see the module docstring). ``.result`` holds the last ``Replay``,
    ``.error`` the last failure, ``.view.artists`` what the bars drew."""

    def __init__(
        self, model: ScrubberModel, replay: ReplayWith, *, top: int = 12, samples: int = 8
    ) -> None:
        w = require("ipywidgets", "dstt.widgets.scrubber")
        if not (callable(replay) or isinstance(replay, Mapping)):
            raise TypeError(
                "replay= takes run.replay's keyword arguments as a dict (model=, "
                "optimizer=, loss_fn=, dataset=, ...) or a callable step -> "
                f"Replay, not {type(replay).__name__}"
            )
        if isinstance(replay, Mapping) and not {"model", "optimizer"} <= set(replay):
            raise TypeError(
                "replay= needs at least model= and optimizer= (the objects the "
                "step is restored into), as run.replay does"
            )
        self.model, self.replay_with = model, replay
        self.top, self.samples = top, samples
        self.result: Replay | None = None
        self.error: BaseException | None = None
        self.button = w.Button(
            description="replay",
            icon="play",
            tooltip="re-execute this step from the commit before it",
            layout=w.Layout(width="auto"),
        )
        self.status = w.HTML()
        self.view = FigureView((5, 3.8))
        self.image = w.Image(format="png")
        self.image.add_class("dstt-view-replay")
        self.table = w.HTML()
        self.table.add_class("dstt-replay-samples")
        #: why the spike happened (``run.explain``), shown after a spike's replay
        self.explanation: Explanation | None = None
        self.why = w.HTML()
        self.why.add_class("dstt-replay-explain")
        self.button.on_click(lambda _: self.run())
        self.widget = w.VBox(
            [w.HBox([self.button, self.status]), w.HBox([self.image, self.table]), self.why]
        )
        self.update()

    def target(self) -> int | Spike:
        """What a click replays: the spike at the current step, else the step itself."""
        spike = self.model.spike
        return spike if spike is not None else self.model.step

    def update(self) -> None:
        """Follow the scrubber's step: the button names what it would replay."""
        t = self.target()
        self.button.description = (
            f"replay the spike at step {t.step}" if not isinstance(t, int) else f"replay step {t}"
        )

    def run(self) -> Replay | None:
        """Replay the current target and show the result; returns the ``Replay`` (None on
        an error, which the status line shows)."""
        t = self.target()
        step = t if isinstance(t, int) else t.first_step
        self.status.value = f"replaying step {step}…"
        result: Replay
        try:
            if isinstance(self.replay_with, Mapping):
                kwargs = {"timeline": self.model.timeline, **self.replay_with}
                result = self.model.run.replay(t, **kwargs)
            else:
                result = self.replay_with(t)
        except Exception as e:
            self.error, self.result = e, None
            self.status.value = error_html(f"replay of step {step} failed", e)
            return None
        self.error, self.result = None, result
        self.show(result)
        self.explain(t)
        return result

    def explain(self, target: int | Spike) -> None:
        """Under a spike's replay, why it happened (:meth:`dstt.Run.explain`, with the
        panel's replay objects when they are keyword arguments); nothing for a plain step."""
        self.explanation, self.why.value = None, ""
        if isinstance(target, int):
            return
        replay = self.replay_with if isinstance(self.replay_with, Mapping) else None
        try:
            self.explanation = self.model.run.explain(
                target, replay=replay, timeline=self.model.timeline
            )
        except Exception as e:  # shown, as a replay's failure is: the panel stays usable
            self.why.value = error_html("explain failed", e)
            return
        self.why.value = self.explanation._repr_html_()

    def show(self, result: Replay) -> None:
        """Draw a ``Replay``: faithful line, gradient-norm bars, worst-samples table."""
        verdict = (
            "faithful: bit-exact against its commit"
            if result.faithful
            else f"NOT faithful: max |diff| {result.max_abs_diff:.3g} over "
            f"{len(result.differs)} tensors"
        )
        loss = float(np.sum(result.losses)) if result.losses else float("nan")
        self.status.value = (
            f"<span class='dstt-replay-status' data-step='{result.step}' "
            f"data-faithful='{str(result.faithful).lower()}'>step "
            f"{result.step} replayed · {html.escape(verdict)} · loss "
            f"{loss:.4g}</span>"
        )
        top = result.top(self.top)

        def bars(ax: Axes) -> dict[str, Any]:
            out = draw_bars(
                ax,
                [n for n, _ in top],
                [v for _, v in top],
                xlabel="‖grad‖",
                log=True,
                title=f"gradient norms, step {result.step}",
            )
            out["names"] = [n for n, _ in top]
            return out

        self.view.redraw(bars)
        self.image.value = self.view.png()
        self.table.value = samples_table(result.per_sample, self.samples)


def error_html(what: str, e: BaseException) -> str:
    """``what: <the error>`` in red, for a label or status line."""
    return f"<span style='color:#b00'>{what}: {html.escape(f'{type(e).__name__}: {e}')}</span>"


def samples_table(per_sample: xr.Dataset, n: int) -> str:
    """The ``n`` worst samples of a replay's ``per_sample`` dataset as an HTML table."""
    if "index" not in per_sample or per_sample.sizes.get("sample", 0) == 0:
        return "<i>no per-sample losses (per_sample=False, or batches without a size)</i>"
    cols = [
        c
        for c in ("index", "micro_batch", "loss", "grad_norm")
        if c in per_sample and not (c == "grad_norm" and np.all(np.isnan(per_sample[c].values)))
    ]
    head = "".join(f"<th>{c}</th>" for c in cols)

    def cell(v: Any) -> str:  # noqa: ANN401 - a numpy scalar
        return f"<td>{v:.4g}</td>" if isinstance(v, float | np.floating) else f"<td>{int(v)}</td>"

    rows = "".join(
        f"<tr>{''.join(cell(per_sample[c].values[i]) for c in cols)}</tr>"
        for i in range(min(n, per_sample.sizes["sample"]))
    )
    return f"<b>worst samples</b><table><tr>{head}</tr>{rows}</table>"
