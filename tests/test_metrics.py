"""The gateway's Prometheus metrics (`gateway.metrics`): latency observations made on the event loop are held back and
put in their histograms together, and none is lost."""

from __future__ import annotations

import asyncio

import pytest

from gateway.metrics import HOLD_S, GatewayMetrics

pytestmark = pytest.mark.timeout(30)


def _count(metrics: GatewayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


async def test_held_observations_reach_their_histograms_within_the_hold_and_at_a_scrape():
    metrics = GatewayMetrics()
    metrics.ttfb.observe(0.02)
    metrics.engine_ttfb.observe(0.01)
    assert _count(metrics, "voxgate_ttfb_seconds_count") == 0  # held: not on the path to the turn's audio
    await asyncio.sleep(HOLD_S * 2)
    assert _count(metrics, "voxgate_ttfb_seconds_count") == 1
    assert _count(metrics, "voxgate_engine_ttfb_seconds_sum") == pytest.approx(0.01)
    metrics.gap.observe(0.03)
    metrics.rtf.observe(0.4)
    text = metrics.render().decode()  # a scrape puts in what is held first
    assert "voxgate_playout_gap_seconds_count 1.0" in text
    assert "voxgate_turn_rtf_count 1.0" in text
    assert 'voxgate_turn_rtf_bucket{le="0.5"} 1.0' in text


def test_outside_an_event_loop_an_observation_goes_in_at_once():
    metrics = GatewayMetrics()
    metrics.ttfb.observe(0.02)
    assert _count(metrics, "voxgate_ttfb_seconds_count") == 1
