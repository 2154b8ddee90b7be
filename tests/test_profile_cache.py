"""specbench.costs.profile.load_or_measure_target: a cached cost profile is reused only when the
target, device, dtype and the engine's code all match; one from other engine code is measured again."""
from __future__ import annotations

import json

from specbench.costs import profile
from specbench.engine.dtypes import dtype_name
from helpers import tiny_target


def test_cached_profile_is_reused_only_for_the_same_engine_code(tmp_path, monkeypatch):
    target = tiny_target()
    measured = []

    def fake_measure(t):
        measured.append(t.name)
        return {"entries": [], "target_fingerprint": t.fingerprint, "marker": "new",
                "device_name": profile.device_name(t.model.device),
                "dtype": dtype_name(t.model.lm_head.weight.dtype), "engine_digest": profile.engine_digest()}

    monkeypatch.setattr(profile, "measure_profile", fake_measure)
    monkeypatch.setattr(profile, "committed_profiles", lambda: [])
    folder = tmp_path / "profiles"
    folder.mkdir()
    stale = {"entries": [], "target_fingerprint": target.fingerprint, "marker": "stale",
             "device_name": profile.device_name(target.model.device),
             "dtype": dtype_name(target.model.lm_head.weight.dtype), "engine_digest": "0123456789ab"}
    (folder / "old.json").write_text(json.dumps(stale))
    assert profile.load_or_measure_target(target, tmp_path)["marker"] == "new"
    assert measured == [target.name]
    assert profile.load_or_measure_target(target, tmp_path)["marker"] == "new"  # cached now, not measured again
    assert measured == [target.name]
    assert len(profile.engine_digest()) == 12 and profile.engine_digest() == profile.engine_digest()
