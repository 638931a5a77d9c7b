"""A control panel for training runs in a notebook: settings, Start/Stop, progress, live plots.

    from pilab import cluster, widgets
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

import html

import dataclasses
import os

import ipywidgets as W

from . import plots
from .config import CHOICES, Config, ConfigError, small_mode
from .model_names import MODEL_NAMES, WIDTH_RANGE

__all__ = ["ControlPanel", "quickstart_config", "small_mode"]


def quickstart_config(live: bool = False, **overrides) -> Config:
    """Settings for the quickstart notebook: a short run on a laptop (about a minute on 2 cores).

    ``live=True`` gives the live-panel run, a few epochs longer. ``PILAB_NB_SMALL=1`` (the default
    under ``CI=true`` and in kernels that pytest/nbval starts) shrinks everything to seconds; ``PILAB_NB_LIVE_EPOCHS=N`` sets the live run's epochs (the
    browser test uses a long one so it can press Stop)::

        cfg = widgets.quickstart_config()
        cfg = widgets.quickstart_config(epochs=3)     # any Config field
    """
    small = small_mode()
    if small:
        base = dict(width=0.25, train_subset=256, test_subset=128, epochs=1, batch_size=16)
    else:
        base = dict(width=0.5, train_subset=2000, test_subset=500, epochs=2, batch_size=32)
    if live:
        base["epochs"] = int(os.environ.get("PILAB_NB_LIVE_EPOCHS") or (1 if small else 5))
    base.update(model="mobilenetv2_cifar", lr_scaling="linear", warmup_epochs=0.0)
    base.update(overrides)
    return Config(**base)


# Widget per Config field: (field, factory). Order = order on screen.
def _dropdown(name: str, options, value, **kw):
    return W.Dropdown(options=list(options), value=value, description=name.replace("_", " "),
                      tooltip=Config.help(name), style={"description_width": "initial"}, **kw)


class ControlPanel:
    """Settings, Start/Stop buttons, a progress bar and live plots for runs on ``lab``'s engines
    (a :class:`pilab.cluster.Engines`, or None to train in this kernel). See the module docstring.

    ``settings_only=True`` shows just the settings, for a cell below that reads ``panel.config()``
    (a study picks its own process counts, so a process slider or live plots would mislead)::

        panel = widgets.ControlPanel(None, scaling.notebook_config(), settings_only=True)
        study = scaling.study(panel.config(), **scaling.notebook_sweep())
    """

    def __init__(self, lab=None, cfg: Config | None = None, *, live: plots.LivePlot | None = None,
                 settings_only: bool = False):
        self.lab = lab
        self.settings_only = settings_only
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
        self.controls = {
            "model": _dropdown("model", MODEL_NAMES, c.model),
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
        }
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
        squeeze = not self.controls["model"].value.startswith("mobilenetv2")
        w = self.controls["width"]
        if squeeze:
            w.value = 1.0
        w.disabled = squeeze

    def _guard(self, fn):
        # Button callbacks have nowhere to raise to: show the error on the panel instead.
        try:
            fn()
        except Exception as e:
            self._say(f"<span style='color:#c00'>{type(e).__name__}: {e}</span>")

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
        if self.lab is not None:
            self.run = self.lab.train(cfg, np_, callbacks=callbacks)
        else:
            from .cluster import LocalRun

            self.run = LocalRun(cfg, callbacks=callbacks)
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
        """Wait for the current run (see :meth:`pilab.cluster.Run.wait`) and return its result."""
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
            self._say(("stopped early: " if res.get("stopped_early") else "done: ")
                      + plots._summary(res))
            self._idle()
        elif kind == "error":
            self.progress.bar_style = "danger"
            self._say(f"<span style='color:#c00'>{event.get('message')}</span>")
            self._idle()

    def _idle(self) -> None:
        self.start_button.disabled, self.stop_button.disabled = False, True
