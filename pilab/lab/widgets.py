"""A control panel for training runs in a notebook: settings, Start/Stop, progress, live plots.

    from pilab.lab import cluster, widgets
    lab = cluster.start(n=2)
    panel = widgets.ControlPanel(lab, widgets.quickstart_config())
    panel                      # shows the controls and the live plots
    run = panel.start()        # same as pressing Start
    result = panel.wait()      # Stop (or interrupting the kernel) ends every rank after its step

Every control maps to one ``Config`` field; dropdowns list ``config.CHOICES`` and tooltips are
``Config.help(name)``, so the panel, the CLI and validation agree. Without engines
(``ControlPanel(None, cfg)``) runs go in this kernel, on one process.
"""
from __future__ import annotations

import copy
import dataclasses
import html
import os

import ipywidgets as W

from .. import plots
from ..config import CHOICES, Config, ConfigError, small_mode
from ..models import MODEL_NAMES, WIDTH_RANGE

__all__ = ["ControlPanel", "Progress", "quickstart_config", "small_mode"]


def quickstart_config(live: bool = False, **overrides) -> Config:
    """Settings for the quickstart notebook: a short run on a laptop (about a minute on 2 cores).

    ``live=True`` gives the live-panel run, a few epochs longer. ``PILAB_NB_SMALL=1`` (the default
    under ``CI=true`` and in kernels that pytest starts) is the one-core budget: the ``%%px`` run
    only shows the ranks at work (512 images, one epoch, seconds), the live run learns (2,000 images,
    4 epochs, 124 steps of 64 at np=2: ~33% test accuracy, ~30 s on one idle core);
    ``PILAB_NB_LIVE_EPOCHS=N`` sets the live run's epochs::

        cfg = widgets.quickstart_config()
        cfg = widgets.quickstart_config(epochs=3)     # any Config field
    """
    small = small_mode()
    if small:
        base = dict(width=0.25, train_subset=512, test_subset=250, epochs=1, batch_size=32, threads=1)
        if live:  # the demo's training (MobileNetV2 needs ~250 steps of 32 images to learn)
            base.update(train_subset=2000, test_subset=500, epochs=4)
    else:
        base = dict(width=0.5, train_subset=2000, test_subset=500, epochs=2, batch_size=32)
        if live:
            base["epochs"] = 5
    if live and os.environ.get("PILAB_NB_LIVE_EPOCHS"):
        base["epochs"] = int(os.environ["PILAB_NB_LIVE_EPOCHS"])
    base.update(model="mobilenetv2_cifar", lr_scaling="linear", warmup_epochs=0.0)
    base.update(overrides)
    return Config(**base)


# Widget per Config field: (field, factory). Order = order on screen.
def _dropdown(name: str, options, value, **kw):
    return W.Dropdown(options=list(options), value=value, description=name.replace("_", " "),
                      tooltip=Config.help(name), style={"description_width": "initial"}, **kw)

def _controls(c: Config, style: dict) -> dict:
    """The panel's settings, each a widget holding ``c``'s value (``ControlPanel.config`` reads them back)."""
    return {
        # a registered name from the list, or your own builder typed in: package.module:function
        "model": W.Combobox(options=list(MODEL_NAMES), value=c.model, ensure_option=False,
                            placeholder="a name, or mynets:builder", description="model",
                            tooltip=Config.help("model"), style=style, continuous_update=False),
        "width": W.FloatSlider(value=c.width, min=WIDTH_RANGE[0], max=WIDTH_RANGE[1], step=0.05,
                               description="width", tooltip=Config.help("width"), style=style,
                               continuous_update=False),
        "epochs": W.BoundedIntText(value=c.epochs, min=1, max=1000, description="epochs",
                                   tooltip=Config.help("epochs"), style=style),
        "batch_mode": _dropdown("batch_mode", CHOICES["batch_mode"], c.batch_mode),
        "batch_size": W.BoundedIntText(value=c.batch_size, min=1, max=65536, description="batch size",
                                       tooltip=Config.help("batch_size"), style=style),
        "sharding": _dropdown("sharding", CHOICES["sharding"], c.sharding),
        "lr_scaling": _dropdown("lr_scaling", CHOICES["lr_scaling"], c.lr_scaling),
        "warmup_epochs": W.BoundedFloatText(value=c.warmup_epochs, min=0.0, max=1000.0, step=0.5,
                                            description="warmup epochs",
                                            tooltip=Config.help("warmup_epochs"), style=style),
        "optimizer": _dropdown("optimizer", CHOICES["optimizer"], c.optimizer),
        "bn": _dropdown("bn", CHOICES["bn"], c.bn),
        # every rank's step on one time axis (pilab.trace.recorder): <out>/trace.json where the run has an out
        "trace": W.Checkbox(value=c.trace, description="trace", tooltip=Config.help("trace"), style=style),
    }


class ControlPanel:
    """Settings, Start/Stop buttons, a progress bar and live plots for runs on ``lab``'s engines
    (a :class:`pilab.lab.cluster.Engines`, or None to train in this kernel). See the module docstring.

    ``settings_only=True`` shows just the settings, for a cell below that reads ``panel.config()``
    (a study picks its own process counts, so a process slider or live plots would mislead).
    ``components``: your own (``pilab.Component``), in every run it starts::

        panel = widgets.ControlPanel(None, scaling.notebook_config(), settings_only=True)   # pilab.study.scaling
        study = scaling.study(panel.config(), **scaling.notebook_sweep())
    """

    def __init__(self, lab=None, cfg: Config | None = None, *, live: plots.LivePlot | None = None,
                 settings_only: bool = False, components=()):
        self.lab = lab
        self.settings_only = settings_only
        self.components = list(components)  # yours (pilab.Component), a fresh copy in every run
        self.base = cfg if cfg is not None else quickstart_config(live=True)
        self.live = live if live is not None or settings_only else plots.LivePlot()
        self.run = None
        self.result = None
        c = self.base
        slots = lab.size if lab is not None else 1
        style = {"description_width": "initial"}
        self.np_ = W.IntSlider(value=slots, min=1, max=slots, step=1, description="processes",
                               tooltip=f"MPI ranks to train on (1..{slots} engines running); "
                                       "the others wait", style=style, continuous_update=False)
        self.controls = _controls(c, style)
        # SqueezeNet has no width multiplier: grey the slider out rather than let validation refuse.
        self.controls["model"].observe(self._model_changed, names="value")
        self._model_changed()
        self.start_button = W.Button(description="Start", button_style="success", icon="play",
                                     tooltip="train with these settings on the chosen processes")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True, tooltip="every rank stops after its current step")
        self.start_button.on_click(lambda _: self._guard(self.start))
        self.stop_button.on_click(lambda _: self._guard(self.stop))
        self.progress = W.IntProgress(value=0, min=0, max=1, description="steps",
                                      layout=W.Layout(width="420px"))
        self.status = W.HTML("ready")
        ctl = list(self.controls.values())
        if settings_only:
            self.live_widget = None
            self.widget = W.VBox([W.HTML("<b>Settings</b> (the next cells read them with "
                                         "<code>panel.config()</code>)"),
                                  W.GridBox(ctl, layout=W.Layout(grid_template_columns="repeat(3, 300px)"))])
            return
        self.live_widget = self.live.widget()
        grid = W.GridBox([self.np_] + ctl,
                         layout=W.Layout(grid_template_columns="repeat(3, 300px)"))
        self.widget = W.VBox([grid, W.HBox([self.start_button, self.stop_button, self.progress]),
                              self.status, self.live_widget])

    # -- display ---------------------------------------------------------------------------------
    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _model_changed(self, *_):
        name = self.controls["model"].value
        squeeze = name in MODEL_NAMES and not name.startswith("mobilenetv2")  # your own builder may take a width
        w = self.controls["width"]
        if squeeze:
            w.value = 1.0
        w.disabled = squeeze

    def _guard(self, fn):
        # Button callbacks have nowhere to raise to: show the error on the panel instead.
        try:
            fn()
        except Exception as e:
            self._say(f"<span style='color:#c00'>{html.escape(f'{type(e).__name__}: {e}')}</span>")

    def _say(self, html: str) -> None:
        self.status.value = html

    # -- settings --------------------------------------------------------------------------------
    def config(self) -> Config:
        """The Config the controls describe (raises ConfigError for a bad combination)."""
        values = {k: w.value for k, w in self.controls.items()}
        return dataclasses.replace(self.base, **values)

    # -- running ---------------------------------------------------------------------------------
    def start(self):
        """Start a run with the current settings; returns the Run at once."""
        if self.settings_only:
            raise ConfigError("this panel only holds settings; pass panel.config() to the study, or build "
                              "ControlPanel(lab, cfg) to train from it")
        if self.run is not None and not self.run.done:
            raise ConfigError("a run is still going; press Stop or wait for it")
        cfg = self.config()
        np_ = self.np_.value
        cfg.per_rank_batch(np_)  # a global batch that does not split over np fails here, not later
        self.result = None
        self.progress.value, self.progress.max, self.progress.bar_style = 0, 1, ""
        callbacks = [self.live, self._on_event]
        components = [copy.deepcopy(c) for c in self.components]
        if self.lab is not None:
            self.run = self.lab.train(cfg, np_, callbacks=callbacks, components=components)
        else:
            from .cluster import LocalRun

            self.run = LocalRun(cfg, callbacks=callbacks, components=components)
        self.start_button.disabled, self.stop_button.disabled = True, False
        self._say(f"starting on {np_} process(es)…")
        return self.run

    def stop(self) -> None:
        """Ask every rank to stop after its current step."""
        if self.run is not None and not self.run.done:
            self.run.stop()
            self.stop_button.disabled = True
            self._say("stopping after the current step…")

    def wait(self, timeout: float | None = None) -> dict | None:
        """Wait for the current run (see :meth:`pilab.lab.cluster.Run.wait`) and return its result."""
        if self.run is None:
            return None
        self.result = self.run.wait(timeout)
        return self.result

    def _on_event(self, event) -> None:
        kind = event.get("kind")
        if kind == "start":
            self.progress.max = max(int(event.get("total_steps") or 1), 1)
            self._say(f"running on {event.get('np')} process(es)")
        elif kind == "step":
            if event.get("total_steps"):  # a noise-driven batch ramp changes it as it chooses
                self.progress.max = max(int(event["total_steps"]), 1)
            self.progress.value = int(event["global_step"])
            self.progress.description = f"{event['global_step']}/{event.get('total_steps', '?')}"
        elif kind == "epoch":
            acc = event.get("test_acc")
            self._say(f"epoch {event['epoch']}: train acc {event['train_acc']:.3f}"
                      + (f", test acc {acc:.3f}" if acc is not None else ""))
        elif kind == "straggler":  # the live plot marks the rank's bar; the panel says why
            self._say(html.escape(event.get("line", "").replace("pilab: ", "", 1)))
        elif kind == "end":
            res = event["result"]
            self.progress.bar_style = "warning" if res.get("stopped_early") else "success"
            # the numbers are in the live plot's title just below: say only how it ended
            self._say(f"stopped early, after step {res.get('steps_done', '?')} of {res.get('total_steps', '?')}"
                      if res.get("stopped_early") else "done")
            self._idle()
        elif kind == "error":
            self.progress.bar_style = "danger"
            self._say(f"<span style='color:#c00'>{html.escape(str(event.get('message')))}</span>")
            self._idle()

    def _idle(self) -> None:
        self.start_button.disabled, self.stop_button.disabled = False, True


class Progress:
    """A progress bar for a cell that runs several trainings (a study, the ablations, a remedies
    search): which run goes on, how many are done, the time so far and an estimate of the time left.
    Pass it as a callback; it shows itself with the first event::

        study = scaling.study(cfg, nps=(1, 2), simulate_nps=(8,), callbacks=[widgets.Progress()])
        abl = ablation.ablations(cfg, 4, callbacks=[widgets.Progress()])   # pilab.study

    It reads the events those calls send (``point`` before a run, ``step`` during a simulated one,
    ``run`` / ``candidate`` after one, ``stopped``). The estimate: the runs of one call train the same
    images, so the time left is the mean time of the runs done times the runs left, the current run's
    share taken from its steps where it reports them (a real MPI job does not: its share is its time so
    far against the mean). A clock thread redraws it every second while the cell runs.
    """

    def __init__(self, what: str = "runs"):
        self.what = what
        self.bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, bar_style="info",
                                   layout=W.Layout(width="360px"))
        self.label = W.HTML("waiting for the first run…")
        self.widget = W.HBox([self.bar, self.label])
        self._shown = False
        self._t0 = self._point_t0 = None
        self._index, self._of, self._name = 0, 1, ""
        self._done: list[float] = []  # seconds each finished run took (kept ones excluded)
        self._step = None  # (global_step, total_steps) of the current run
        self._finished = False
        self._clock = None

    def _ipython_display_(self):
        from IPython.display import display

        self._shown = True
        display(self.widget)

    def __call__(self, event) -> None:
        import time

        kind = event.get("kind")
        now = time.monotonic()
        if not self._shown:
            self._ipython_display_()
        if self._t0 is None:
            self._t0 = now
            self._start_clock()
        if kind == "point":
            if self._point_t0 is not None:  # the run before sent no event of its end (a reference run)
                self._done.append(now - self._point_t0)
            self._index, self._of = int(event.get("index", 0)), max(int(event.get("of", 1)), 1)
            self._name, self._point_t0, self._step = str(event.get("label", "")), now, None
        elif kind == "step" and event.get("total_steps"):
            self._step = (int(event["global_step"]), int(event["total_steps"]))
        elif kind in ("run", "candidate"):
            kept = event.get("kept") or (event.get("result") or {}).get("reused_from")
            if self._point_t0 is not None and not kept:
                self._done.append(now - self._point_t0)
            self._index, self._point_t0, self._step = self._index + 1, None, None
            if self._index >= self._of:
                self._finish("done")
        elif kind == "stopped":
            self._finish("stopped")
        self._draw()

    # -- drawing -------------------------------------------------------------------------------
    def _fraction_of_current(self, now: float) -> float | None:
        if self._point_t0 is None:
            return None
        if self._step:
            return min(self._step[0] / max(self._step[1], 1), 1.0)
        if self._done:  # a real MPI job reports no steps: its time so far against the mean run's
            return min((now - self._point_t0) / (sum(self._done) / len(self._done)), 0.95)
        return None

    def _draw(self) -> None:
        import time

        now = time.monotonic()
        elapsed = now - self._t0 if self._t0 is not None else 0.0
        frac = self._fraction_of_current(now)
        self.bar.value = min((self._index + (frac or 0.0)) / self._of, 1.0)
        if self._finished:
            self.label.value = (f"{self.what}: {self._state}, {self._index} of {self._of} in "
                                f"{_seconds(elapsed)}")
            return
        left = None
        if self._step and frac and self._point_t0 is not None and now - self._point_t0 > 2:
            per_run = (now - self._point_t0) / frac
            left = per_run * (1 - frac) + per_run * (self._of - self._index - 1)
        elif self._done:
            per_run = sum(self._done) / len(self._done)
            left = max(per_run * (self._of - self._index) - (now - self._point_t0 if self._point_t0 else 0), 0)
        est = f"about {_seconds(left)} left" if left is not None else "estimating the time left…"
        name = f" — <b>{html.escape(self._name)}</b>" if self._name else ""
        self.label.value = (f"{self.what} {min(self._index + 1, self._of)} of {self._of}{name}; "
                            f"{_seconds(elapsed)} so far, {est}")

    def _finish(self, state: str) -> None:
        self._finished, self._state = True, state
        self.bar.bar_style = "success" if state == "done" else "warning"

    def _start_clock(self) -> None:
        """Redraw every second while the cell that started it runs (the time so far must move during
        a real MPI job, which sends no events); it ends with the run, or when another cell starts."""
        import threading

        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            shell = None
        cell = getattr(shell, "execution_count", None)

        def tick():
            while not self._finished:
                if shell is not None and getattr(shell, "execution_count", None) != cell:
                    self._finish("ended")  # the cell ended before the last run (an error, a skipped run)
                    self._draw()
                    return
                self._draw()
                self._wake.wait(1.0)

        self._wake = threading.Event()
        self._clock = threading.Thread(target=tick, name="pilab-progress", daemon=True)
        self._clock.start()


def _seconds(s: float) -> str:
    """``42 s``, ``3 min 05 s``."""
    s = int(round(s))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"
