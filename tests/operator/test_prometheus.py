"""The rebalancer's Prometheus client against a real Prometheus scraping real exporters every second:
the routers and sidecars of two CacheShards with the same name and the same pod names in two
namespaces, so every heat reading must keep to its own shard."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from traffic import Traffic, running_prometheus, scrape_config, wait_scraped

from kvshard_local.testing_servers import PrometheusServer, free_port
from kvshard_operator.prometheus import Heat, PrometheusClient, PrometheusError, promql_string

WINDOW = 4.0  # 4× the scrape interval
PODS = ("engine-0", "engine-1", "engine-2")
A = ("team-a", "movies")
B = ("team-b", "movies")  # same name, same pod names, another namespace


@pytest.fixture(scope="module")
def traffic() -> Iterator[Traffic]:
    """Shard A's router and sidecars."""
    t = Traffic(PODS, shards=["/".join(A)])
    t.set(clusters={0: 40.0, 1: 10.0, 2: 0.0},
          load={"engine-0": 30.0, "engine-1": 10.0},
          tokens={"engine-0": (90.0, 100.0), "engine-1": (20.0, 100.0), "engine-2": (0.0, 0.0)})
    yield t
    t.close()


@pytest.fixture(scope="module")
def other(traffic: Traffic) -> Iterator[Traffic]:
    """Shard B's router and sidecars: cluster 0 and pods engine-0 and engine-2 again, other rates,
    and a cluster 3 that A does not have."""
    t = Traffic(PODS, shards=["/".join(B)])
    t.set(clusters={0: 5.0, 3: 50.0},
          load={"engine-0": 5.0, "engine-2": 25.0},
          tokens={"engine-0": (10.0, 100.0), "engine-2": (50.0, 100.0)})
    yield t
    t.close()


@pytest.fixture(scope="module")
def prometheus(traffic: Traffic, other: Traffic, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[PrometheusServer]:
    with running_prometheus(scrape_config(traffic, other), tmp_path_factory.mktemp("prometheus")) as server:
        yield server


@pytest.fixture(scope="module")
def scraped(prometheus: PrometheusServer) -> PrometheusServer:
    """Prometheus once it holds a full window of samples of every exporter."""
    wait_scraped(prometheus.url, WINDOW, targets=2 * (1 + len(PODS)))
    return prometheus


async def test_heat_reads_cluster_rates_pod_load_and_item_hit_ratio(scraped: PrometheusServer) -> None:
    async with PrometheusClient(scraped.url) as client:
        heat = await client.heat(*A, WINDOW)

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


async def test_heat_counts_only_the_shard_s_own_series(scraped: PrometheusServer) -> None:
    """Summed over both shards, A would gain cluster 3 and B clusters 1 and 2, engine-0's hit ratio
    would be 50 % in both, and engine-2 would have load and a hit ratio in A."""
    async with PrometheusClient(scraped.url) as client:
        a = await client.heat(*A, WINDOW)
        b = await client.heat(*B, WINDOW)
        assert await client.heat("team-c", "movies", WINDOW) == Heat({}, {}, {})  # nobody's traffic

    assert set(a.cluster_rates) == {0, 1, 2} and set(b.cluster_rates) == {0, 3}
    assert b.cluster_rates[3] / b.cluster_rates[0] == pytest.approx(10.0, rel=0.25)
    assert a.cluster_rates[0] / b.cluster_rates[0] == pytest.approx(8.0, rel=0.25)
    assert set(a.pod_load) == {"engine-0", "engine-1"} and set(b.pod_load) == {"engine-0", "engine-2"}
    assert a.pod_load["engine-0"] / b.pod_load["engine-0"] == pytest.approx(6.0, rel=0.25)
    assert a.pod_hit_ratio["engine-0"] == pytest.approx(0.9, abs=0.05)
    assert b.pod_hit_ratio["engine-0"] == pytest.approx(0.1, abs=0.05)
    assert b.pod_hit_ratio["engine-2"] == pytest.approx(0.5, abs=0.05) and "engine-2" not in a.pod_hit_ratio
    assert "engine-1" not in b.pod_hit_ratio


@pytest.mark.parametrize("value", ['team-a/"movies"', "back\\slash", "new\nline\ttab\x01", "ünï/côdé", ""])
async def test_a_label_value_is_quoted_so_prometheus_reads_it_back_unchanged(
    scraped: PrometheusServer, value: str
) -> None:
    async with PrometheusClient(scraped.url) as client:
        [(labels, _)] = await client.query(f'label_replace(vector(1), "v", {promql_string(value)}, "", "")')
    assert labels.get("v", "") == value  # an empty value is no label at all


async def test_a_metric_nobody_exports_yet_is_empty_not_an_error(scraped: PrometheusServer) -> None:
    async with PrometheusClient(scraped.url) as client:
        assert await client.query("sum by (cluster) (rate(kvshard_router_not_there_total[4s]))") == []
        assert await client.by_label("kvshard_router_not_there_total", "cluster") == {}


async def test_unreachable_prometheus_raises_one_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with PrometheusClient(url, timeout=2) as client:
        with pytest.raises(PrometheusError, match=rf"{url} unreachable"):
            await client.heat(*A, WINDOW)


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
