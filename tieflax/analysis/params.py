"""Parameter accounting lives in ``tieflax.model.params``; this name is kept for code that imports it here."""

from tieflax.model.params import ParamReport, abstract_params, count_params, format_table, param_report

__all__ = ["ParamReport", "abstract_params", "count_params", "format_table", "param_report"]
