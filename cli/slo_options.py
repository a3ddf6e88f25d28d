"""The SLO table the command-line options describe (``--slo``, ``--slo-file``, a config's ``[slo]``),
shared by ``servelab replay``'s report and ``servelab score``/``sweep``.
"""

from __future__ import annotations


def slo_from_options(slo_specs: tuple[str, ...] = (), slo_file: str | None = None, config_file: str | None = None):
    """The SloTable the options describe (None if none was given).

    Precedence, field by field: ``--slo`` flags > ``--slo-file`` > an ``[slo]`` table in the replay
    ``--config`` file.
    """
    return slo_and_source(slo_specs, slo_file, config_file)[0]


def slo_and_source(slo_specs: tuple[str, ...] = (), slo_file: str | None = None, config_file: str | None = None):
    """``(SloTable or None, source)``: the SLO as ``slo_from_options`` reads it and where it came from, for the
    report's header. The source is ``"given"`` (``--slo``/``--slo-file`` alone), ``"the [slo] table in FILE"``
    (the ``--config`` file alone) or ``"given with --slo over the [slo] table in FILE"`` (both); None without
    an SLO.
    """
    from servelab.scoring.slo import SloTable  # (on use: importing scoring starts DuckDB)

    table = SloTable()
    from_config = False
    if config_file:
        import tomllib

        try:
            with open(config_file, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError):
            data = {}  # config_from_options reports a bad config file with its own message
        if isinstance(data.get("slo"), dict):
            table = SloTable.from_toml({"slo": data["slo"]}, config_file)
            from_config = not table.is_empty
    if slo_file:
        table = table.overridden_by(SloTable.from_toml_file(slo_file))
    if slo_specs:
        table = table.overridden_by(SloTable.parse_cli(list(slo_specs)))
    if table.is_empty:
        return None, None
    if not from_config:
        return table, "given"
    flags = " and ".join(name for name, used in (("--slo", slo_specs), ("--slo-file", slo_file)) if used)
    in_config = f"the [slo] table in {config_file}"
    return table, (f"given with {flags} over {in_config}" if flags else in_config)


__all__ = ["slo_and_source", "slo_from_options"]
