"""The rebalancer's Prometheus client against a real Prometheus scraping real exporters every second."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from traffic import Traffic, running_prometheus, wait_scraped

from kvshard.testing_servers import PrometheusServer, free_port
from kvshard_operator.prometheus import PrometheusClient, PrometheusError

WINDOW = 4.0  # 4× the scrape interval
PODS = ("engine-0", "engine-1", "engine-2")


@pytest.fixture(scope="module")
def traffic() -> Iterator[Traffic]:
    t = Traffic(PODS)
    t.set(clusters={0: 40.0, 1: 10.0, 2: 0.0},
          load={"engine-0": 30.0, "engine-1": 10.0},
          tokens={"engine-0": (90.0, 100.0), "engine-1": (20.0, 100.0), "engine-2": (0.0, 0.0)})
    yield t
    t.close()


@pytest.fixture(scope="module")
def prometheus(traffic: Traffic, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    with running_prometheus(traffic.scrape_config(), tmp_path_factory.mktemp("prometheus")) as server:
        yield server


@pytest.fixture(scope="module")
def scraped(prometheus: PrometheusServer) -> PrometheusServer:
    """Prometheus once it holds a full window of samples of every exporter."""
    wait_scraped(prometheus.url, WINDOW, targets=1 + len(PODS))
    return prometheus


async def test_heat_reads_cluster_rates_pod_load_and_item_hit_ratio(scraped: PrometheusServer) -> None:
    async with PrometheusClient(scraped.url) as client:
        heat = await client.heat(WINDOW)

    assert set(heat.cluster_rates) == {0, 1, 2}  # ints, as placement numbers clusters
    assert heat.cluster_rates[0] == pytest.approx(40.0, rel=0.3)
    assert heat.cluster_rates[0] / heat.cluster_rates[1] == pytest.approx(4.0, rel=0.25)
    assert heat.cluster_rates[2] == 0.0
    assert heat.pod_load["engine-0"] == pytest.approx(30.0, rel=0.3)
    assert heat.pod_load["engine-0"] / heat.pod_load["engine-1"] == pytest.approx(3.0, rel=0.25)
    assert "engine-2" not in heat.pod_load  # the router never sent it anything
    # item tokens only (history tokens hit 100 % and must not count), by the scrape's pod label
    assert heat.pod_hit_ratio["engine-0"] == pytest.approx(0.9, abs=0.05)
    assert heat.pod_hit_ratio["engine-1"] == pytest.approx(0.2, abs=0.05)
    assert "engine-2" not in heat.pod_hit_ratio  # 0/0 over the window is no ratio, not 0 %
    assert heat.has_traffic


async def test_a_metric_nobody_exports_yet_is_empty_not_an_error(scraped: PrometheusServer) -> None:
    async with PrometheusClient(scraped.url) as client:
        assert await client.query("sum by (cluster) (rate(kvshard_router_not_there_total[4s]))") == []
        assert await client.by_label("kvshard_router_not_there_total", "cluster") == {}


async def test_unreachable_prometheus_raises_one_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with PrometheusClient(url, timeout=2) as client:
        with pytest.raises(PrometheusError, match=rf"{url} unreachable"):
            await client.heat(WINDOW)


async def test_a_rejected_query_names_the_query_and_prometheus_error(scraped: PrometheusServer) -> None:
    async with PrometheusClient(scraped.url) as client:
        with pytest.raises(PrometheusError, match=r"rejected 'sum by \(\(': HTTP 400, bad_data: .*parse error"):
            await client.query("sum by ((")
        with pytest.raises(PrometheusError, match="is not an instant vector"):
            await client.query('"a string"')


async def test_something_that_is_not_prometheus_is_an_error(traffic: Traffic) -> None:
    url = f"http://{traffic.router.target}"  # a /metrics exporter answers every path with text
    async with PrometheusClient(url) as client:
        with pytest.raises(PrometheusError, match="non-JSON"):
            await client.query("up")
