"""Where shipped specs and drafters are found (specbench/resources.py): $SPECBENCH_HOME first,
then the source checkout, then the installed package data; earlier places fill in first."""
import pytest

from specbench import resources
from specbench.bench.workloads import builtin_workloads, load_workload
from specbench.drafters.checkpoints import resolve_checkpoint
from specbench.errors import UserError
from specbench.policies.registry import builtin_specs, read_spec


def _installed_only(monkeypatch, tmp_path, *, with_data: bool):
    """Pretend the package is a non-editable install: no checkout above it, maybe package data."""
    monkeypatch.setattr(resources, "SOURCE_ROOT", tmp_path / "site-packages")
    monkeypatch.setattr(resources, "INSTALLED_ROOT", tmp_path / "site-packages" / "specbench" / "_shipped")
    monkeypatch.delenv(resources.HOME_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)  # a relative spec path is tried against the working directory first
    if with_data:
        shipped = resources.INSTALLED_ROOT
        (shipped / "policies").mkdir(parents=True)
        (shipped / "policies" / "ar.toml").write_text('name = "ar"\nbuilder = "specbench.policies.registry:build_ar"\n')
        (shipped / "drafters" / "t" / "d").mkdir(parents=True)
        (shipped / "drafters" / "t" / "d" / "drafter.json").write_text("{}")
        return shipped


def test_checkout_is_found_when_running_from_the_repository(monkeypatch):
    monkeypatch.delenv(resources.HOME_VARIABLE, raising=False)
    assert resources.source_checkout() is not None
    assert resources.roots()[0] == resources.source_checkout()
    assert "ar" in builtin_specs() and "code" in builtin_workloads()
    assert resolve_checkpoint("drafters/smollm2-135m/eagle").is_dir()


def test_installed_package_data_is_found_without_a_checkout(monkeypatch, tmp_path):
    shipped = _installed_only(monkeypatch, tmp_path, with_data=True)
    assert resources.roots() == [shipped]
    assert builtin_specs() == {"ar": shipped / "policies" / "ar.toml"}
    assert read_spec("ar")["name"] == "ar"
    assert resolve_checkpoint("drafters/t/d") == shipped / "drafters" / "t" / "d"


def test_nothing_shipped_gives_one_line_errors(monkeypatch, tmp_path):
    _installed_only(monkeypatch, tmp_path, with_data=False)
    assert resources.roots() == [] and builtin_specs() == {}
    with pytest.raises(UserError, match="unknown workload 'code'.*none found"):
        load_workload("code")
    with pytest.raises(UserError, match="no drafter.json"):
        resolve_checkpoint("drafters/smollm2-135m/eagle")


def test_home_overrides_and_the_rest_fills_in(monkeypatch, tmp_path):
    home = tmp_path / "home"
    (home / "policies").mkdir(parents=True)
    (home / "policies" / "pld.toml").write_text('name = "mine"\nbuilder = "specbench.policies.registry:build_pld"\n')
    monkeypatch.setenv(resources.HOME_VARIABLE, str(home))
    specs = builtin_specs()
    assert specs["pld"] == home / "policies" / "pld.toml"  # own spec replaces the shipped one
    assert specs["ar"].parent.parent == resources.source_checkout()  # the rest still found
    assert read_spec("pld")["name"] == "mine"
    assert resolve_checkpoint("drafters/smollm2-135m/eagle").is_dir()  # home has no drafters/


def test_bad_home_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv(resources.HOME_VARIABLE, str(tmp_path / "missing"))
    with pytest.raises(UserError, match="SPECBENCH_HOME=.* is not a directory"):
        builtin_specs()


def test_every_shipped_spec_is_built_by_the_registry():
    """One home for policy builders: every shipped spec names a builder in specbench/policies/registry.py
    that exists there (the policy modules hold only their policies)."""
    from pathlib import Path

    from specbench.policies import registry

    root = Path(__file__).resolve().parent.parent
    specs = [*builtin_specs().values(), *(root / "benchmarks").rglob("policies/*.toml")]
    assert len(specs) > 10
    for spec_path in specs:
        module, _, name = read_spec(str(spec_path))["builder"].partition(":")
        assert module == "specbench.policies.registry" and callable(getattr(registry, name, None)), spec_path
