"""One registry idiom (common/registry.py) for policies, routers, runners and both kinds of importer: a
plug-in is one new file in its registry's package, found by a lookup without any list naming it."""

from __future__ import annotations

import sys
import textwrap

import pytest
from servelab.common.errors import ServelabError
from servelab.common.registry import ClassRegistry, Registry
from servelab.fidelity.base import IMPORTERS as RUN_IMPORTERS
from servelab.policies.base import POLICIES
from servelab.routers.base import ROUTERS
from servelab.runners.base import RUNNERS
from servelab.traces.imported import IMPORTERS as TRACE_IMPORTERS

REGISTRIES = {"policies": POLICIES, "routers": ROUTERS, "runners": RUNNERS, "trace importers": TRACE_IMPORTERS,
              "run importers": RUN_IMPORTERS}


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A fresh package ``plugpkg`` on sys.path; ``add(file, text)`` writes one module into it."""
    pkg = tmp_path / "plugpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [])
    registry = Registry("thing", package="plugpkg")
    monkeypatch.setitem(sys.modules, "plugreg", type(sys)("plugreg"))
    sys.modules["plugreg"].THINGS = registry

    def add(file: str, text: str) -> None:
        (pkg / file).write_text(textwrap.dedent(text))

    yield registry, add
    for name in [m for m in sys.modules if m == "plugpkg" or m.startswith("plugpkg.")]:
        del sys.modules[name]


def test_every_plugin_kind_uses_the_one_idiom():
    for kind, registry in REGISTRIES.items():
        assert type(registry) in (Registry, ClassRegistry), kind
        assert registry.package is not None, f"{kind}: a registry without a package needs its files listed"


@pytest.mark.parametrize("kind", REGISTRIES)
def test_every_registered_name_lives_in_its_registry_package(kind):
    registry = REGISTRIES[kind]
    names = registry.names()
    assert names
    for name in names:
        assert registry.get(name).__module__.startswith(registry.package + "."), (kind, name)


def test_a_new_file_registers_itself_and_only_it_is_imported(plugins):
    registry, add = plugins
    add("new_thing.py", """
        from plugreg import THINGS

        @THINGS.register("new-thing")
        def make():
            return "made"
    """)
    add("other.py", "raise AssertionError('a lookup of new-thing imported other.py')\n")
    assert registry.get("new-thing")() == "made"
    assert "plugpkg.other" not in sys.modules


def test_a_file_named_otherwise_is_found_by_importing_the_package(plugins):
    registry, add = plugins
    add("several.py", """
        from plugreg import THINGS

        THINGS.register("alpha")(1)
        THINGS.register("beta")(2)
    """)
    assert "beta" in registry and registry.get("alpha") == 1
    assert registry.names() == ["alpha", "beta"]


def test_a_module_lacking_an_optional_dependency_is_left_out_and_an_unknown_name_lists_the_rest(plugins):
    registry, add = plugins
    add("heavy.py", "import no_such_package_installed_here\nfrom plugreg import THINGS\nTHINGS.register('heavy')(1)\n")
    add("light.py", """
        from plugreg import THINGS

        THINGS.register("light")(0)
    """)
    with pytest.raises(ServelabError, match=r"unknown thing 'lihgt'; did you mean 'light'\? \(known: light\)"):
        registry.get("lihgt")


def test_a_broken_plugin_is_not_hidden(plugins):
    registry, add = plugins
    add("broken.py", "from plugpkg import missing_module_of_its_own\nfrom plugreg import THINGS\nTHINGS.register('b')(1)\n")
    with pytest.raises(ImportError):
        registry.get("whatever")


def test_a_new_runner_file_is_found_without_an_edit_elsewhere(tmp_path, monkeypatch):
    """The case that needed an edit in runners/base.py before: a runner module the registry was never
    told about, dropped into the package's path, is built by name."""
    import servelab.runners as runners_pkg

    (tmp_path / "constant_for_test.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass

        from servelab.runners.base import RUNNERS, RunnerBase

        class Constant(RunnerBase):
            name = "constant-for-test"
            def __init__(self, step_s):
                self.step_s = step_s
            def step_time(self, plan):
                return self.step_s

        @RUNNERS.register("constant-for-test")
        @dataclass(frozen=True)
        class ConstantParams:
            step_s: float = 0.5
            def build(self, **context):
                return Constant(self.step_s)
    """))
    monkeypatch.setattr(runners_pkg, "__path__", [*runners_pkg.__path__, str(tmp_path)])
    monkeypatch.setattr(RUNNERS, "_items", dict(RUNNERS._items))
    monkeypatch.setattr(RUNNERS, "_loaded", False)  # as in a fresh process
    monkeypatch.delitem(sys.modules, "servelab.runners.constant_for_test", raising=False)
    from servelab.runners.base import make_runner

    assert make_runner("constant-for-test").step_time(None) == 0.5
    assert make_runner("constant-for-test:step_s=0.25").step_time(None) == 0.25  # typed by its Params
    sys.modules.pop("servelab.runners.constant_for_test", None)


def test_a_listing_leaves_helper_modules_alone(plugins):
    """A module that registers nothing (a model the torch runner builds, a table of presets) is not
    imported by a listing or a lookup's package scan: its imports (torch) stay out."""
    registry, add = plugins
    add("helper.py", "raise AssertionError('a listing imported helper.py')\n")
    add("one.py", "from plugreg import THINGS\nTHINGS.register('one')(1)\n")
    assert registry.names() == ["one"]
    assert "plugpkg.helper" not in sys.modules
