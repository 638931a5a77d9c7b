"""Bokeh figures for pilab: live while a run goes on, and from result / study dicts afterwards.

Every function takes plain dicts (a ``pilab.train`` result, a ``pilab.study.scaling.study`` result, or their JSON) and
returns a Bokeh figure or layout, so notebooks and the HTML report draw the same pictures::

    from pilab import plots
    plots.setup_notebook()                 # BokehJS inline: works offline, no CDN
    live = plots.LivePlot()
    live.widget()                          # a jupyter_bokeh BokehModel; display it, then:
    run = lab.train(cfg, callbacks=[live]) # each event streams into the plots

    plots.show(plots.result_layout(result))          # one run: curves + per-rank time split
    html = bokeh.embed.file_html(plots.report_layout(study), INLINE, "scaling")   # the report

One module per kind of picture: ``base`` (what they all share, the notebook's Table and Paragraph),
``run`` (one run, live or afterwards, and its trace's swim lanes), ``study`` (a scaling study and its
report page, a remedies search, a study over seeds, studies side by side and the paper), ``static``
(PNG and SVG with matplotlib).
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "base": ["setup_notebook", "show", "show_committed", "Table", "Paragraph", "html_table", "EXPERIMENTS",
            "STEP_SOURCE", "EPOCH_SOURCE", "RANK_SOURCE", "PARTS", "PART_LABELS", "PART_COLORS"],
    "run": ["LivePlot", "loss_figure", "accuracy_figure", "throughput_figure", "timeline_figure", "rank_label",
           "result_layout", "run_summary"],
    "study": ["speedup_figure", "efficiency_figure", "study_accuracy_figure", "curves_by_np", "energy_figure",
             "scaling_dashboard", "report_layout", "study_cells", "row_kind", "table_notes", "MODE_NOTE",
             "remedies_figure", "seeds_figure", "models_figure", "compare_figures", "paper_figures"],
})
