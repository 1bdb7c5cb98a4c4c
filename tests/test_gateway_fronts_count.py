"""How many gateway fronts serve (`--fronts`, VOXGATE_FRONTS, auto from the cores), bad values as clear errors, and
each front's share of the encode workers."""

from __future__ import annotations

import pytest

from engine.errors import InvalidParameter
from engine.settings import SettingError
from gateway import fronts, offload
from gateway.gateway_config import GatewayConfig
from gateway.settings import GatewaySettings


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (7, 1), (8, 4), (16, 8), (31, 8), (64, 8),
                                                 (128, 8)])
def test_auto_is_one_below_eight_cores_else_half_of_them_at_most_eight(monkeypatch, cores, expected):
    monkeypatch.delenv("VOXGATE_FRONTS", raising=False)
    monkeypatch.setattr(fronts, "usable_cores", lambda: cores)
    assert fronts.front_count(None) == expected
    assert fronts.front_count("auto") == expected


def test_the_flag_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv("VOXGATE_FRONTS", "3")
    assert fronts.front_count(None) == 3
    assert fronts.front_count("2") == 2
    assert fronts.front_count(1) == 1


@pytest.mark.parametrize("raw", ["0", "-1", "two", ""])
def test_bad_values_name_the_setting(raw):
    with pytest.raises(SettingError, match="VOXGATE_FRONTS"):
        GatewaySettings.from_env({"VOXGATE_FRONTS": raw})
    with pytest.raises(InvalidParameter, match="fronts"):
        GatewayConfig(fronts=raw)


def test_each_front_sizes_its_encode_workers_to_its_share(monkeypatch):
    monkeypatch.setattr(offload, "usable_cores", lambda: 16)
    try:
        assert offload.three_quarters_of_cores() == 12
        offload.share_cores(4)
        assert offload.three_quarters_of_cores() == 3
        offload.share_cores(16)
        assert offload.three_quarters_of_cores() == 1  # at least one each
    finally:
        offload.share_cores(1)


@pytest.mark.parametrize("cores, fronts, procs", [(16, 1, 12), (16, 4, 3), (16, 8, 2), (16, 16, 1), (2, 1, 2),
                                                   (1, 1, 1), (64, 8, 2)])
def test_each_front_has_two_encoder_processes_where_it_has_two_cores(monkeypatch, cores, fronts, procs):
    monkeypatch.setattr(offload, "usable_cores", lambda: cores)
    try:
        offload.share_cores(fronts)
        assert offload.default_encode_procs() == procs
    finally:
        offload.share_cores(1)
