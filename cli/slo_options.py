"""The SLO table the command-line options describe (``--slo``, ``--slo-file``, a config's ``[slo]``),
shared by ``servelab replay``'s report and ``servelab score``/``sweep``.
"""

from __future__ import annotations


def slo_from_options(slo_specs: tuple[str, ...] = (), slo_file: str | None = None, config_file: str | None = None):
    """The SloTable the options describe (None if none was given).

    Precedence, field by field: ``--slo`` flags > ``--slo-file`` > an ``[slo]`` table in the replay
    ``--config`` file.
    """
    from servelab.scoring.slo import SloTable  # (on use: importing scoring starts DuckDB)

    table = SloTable()
    if config_file:
        import tomllib

        try:
            with open(config_file, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError):
            data = {}  # config_from_options reports a bad config file with its own message
        if isinstance(data.get("slo"), dict):
            table = SloTable.from_toml({"slo": data["slo"]}, config_file)
    if slo_file:
        table = table.overridden_by(SloTable.from_toml_file(slo_file))
    if slo_specs:
        table = table.overridden_by(SloTable.parse_cli(list(slo_specs)))
    return None if table.is_empty else table


__all__ = ["slo_from_options"]
