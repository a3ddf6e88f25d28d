"""``servelab serve``: an OpenAI-compatible server whose tokens come on the simulated engine's schedule."""

from __future__ import annotations

from typing import Any

import click

from servelab.cli.replay_cmd import ReplayCommand, config_from_options, replay_options
from servelab.common.loops import LOOPS


@click.command(cls=ReplayCommand)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on.")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="Simulated seconds per wall second: 10 runs the engine (and its tokens) 10x faster than real time.")
@click.option("--served-model-name", help="The model name clients ask for (default: the runner's --model preset).")
@click.option("--tokenizer", type=click.Path(dir_okay=False, exists=True),
              help="A local tokenizer.json for prompt lengths (default: about 4 characters a token, said at startup "
                   "and in /v1/models).")
@click.option("--loop", "loop_name", type=click.Choice(LOOPS), default="auto", show_default=True,
              help="The event loop: uvloop (pip install 'servelab[fast]': usually less CPU per request and token), asyncio's "
                   "own, or auto (uvloop when installed).")
@replay_options
def serve(host: str, port: int, time_scale: float, served_model_name: str | None, tokenizer: str | None,
          loop_name: str, **options: Any) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics from the simulated
    engine (one or many replicas behind a router, or a --config cluster) until interrupted."""
    from aiohttp import web

    from servelab.common.errors import ServelabError
    from servelab.common.loops import loop_factory, resolve_loop
    from servelab.serve.app import make_app
    from servelab.serve.prompts import PromptCounter
    from servelab.serve.sim import Simulation

    if not time_scale > 0:
        raise click.BadParameter(f"must be > 0, got {time_scale}", param_hint="--time-scale")
    loop_kind = resolve_loop(loop_name)  # an explicit uvloop that is not installed stops here, before any work
    config = config_from_options(**options)
    counter = PromptCounter(tokenizer)
    try:
        sim = Simulation(config, time_scale)
    except ValueError as err:
        raise ServelabError(str(err)) from err
    model = served_model_name or config.model or "servelab-sim"
    click.echo(f"servelab serve: model '{model}', {len(sim.replicas)} replica(s), runner {config.runner}, "
               f"time scale {time_scale:g}, {loop_kind} event loop; prompt lengths: {counter.description}", err=True)
    click.echo(f"listening on http://{host}:{port}", err=True)
    web.run_app(make_app(sim, model, counter), host=host, port=port, print=None, handle_signals=True,
                handler_cancellation=True, loop=loop_factory(loop_kind)())  # a client that goes away aborts its request
