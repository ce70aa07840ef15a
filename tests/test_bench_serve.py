"""`verispec bench-serve`: served here from checkpoint folders, and against a running server by URL."""

from __future__ import annotations

import asyncio
import json
import resource
from pathlib import Path

import httpx
import pytest
import torch

from verispec import kernels
from verispec.bench.serve import Level, _server_peak_rss, format_table
from verispec.cli import main
from verispec.models.native import load_model
from verispec.serve.app import serving_app
from verispec.serve.server import ServerThread
from verispec.threads import torch_threads


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    path = tmp_path / "suite.jsonl"  # short prompts: the tiny models' context is 256 byte tokens
    path.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(3)))
    return path


def test_bench_serve_local(
    pair_dirs: tuple[Path, Path], suite: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    target, draft = pair_dirs
    code = main(
        [
            "bench-serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "-k",
            "2",
            "--concurrency",
            "1,2",
            "--requests",
            "3",
            "--max-tokens",
            "5",
            "--suite",
            str(suite),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert list(results) == ["autoregressive", "draft k=2"]
    for levels in results.values():
        assert [level["concurrency"] for level in levels] == [1, 2]
        assert all(
            level["tokens"] == 3 * 5 and level["throughput"] > 0 and level["ttft_p99"] >= level["ttft_p50"]
            for level in levels
        )
    if kernels.available(torch.float32):  # exact by default on the kernels: every answer its prompt's alone
        assert all(level["identical"] == level["requests"] for levels in results.values() for level in levels)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "draft k=2 vs autoregressive, output-token throughput by concurrency: 1: " in report
    assert "identical to alone |" in report
    assert "report: " in capsys.readouterr().out


def test_bench_serve_url(pair_dirs: tuple[Path, Path], suite: Path, tmp_path: Path) -> None:
    target = load_model(pair_dirs[0])
    with torch_threads(1), ServerThread(serving_app(target, None, name="plain")) as server:
        code = main(
            [
                "bench-serve",
                "--url",
                f"mine={server.url}",
                "--url",
                server.url,
                "--concurrency",
                "2",
                "--requests",
                "2",
                "--max-tokens",
                "3",
                "--suite",
                str(suite),
                "--out",
                str(tmp_path),
            ]
        )
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert list(results) == ["mine", server.url] and results["mine"][0]["tokens"] == 2 * 3
    # Each server's peak resident memory, from its /metrics (here this process's own, which holds the server).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert all(0 < level["server_peak_rss"] <= peak for levels in results.values() for level in levels)
    row = (tmp_path / "report.md").read_text().split("| mine | 2 |")[1].splitlines()[0]
    assert row.rstrip(" |").split("| ")[-1] == f"{results['mine'][0]['server_peak_rss'] / 2**30:.2f}"


def test_a_server_without_the_peak_in_its_metrics_still_measures() -> None:
    """vLLM's and SGLang's /metrics have no verispec gauge, and a server may have no /metrics: the column says `-`."""

    async def scrape(metrics: httpx.Response) -> float | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda request: metrics)) as client:
            return await _server_peak_rss(client, "http://server")

    for metrics in (httpx.Response(200, text="vllm:num_requests_running 0.0\n"), httpx.Response(404)):
        assert asyncio.run(scrape(metrics)) is None
    level = Level(1, 1, 1, 1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 0.0, 1)
    assert format_table({"theirs": [level]}).splitlines()[-1].endswith("| 1/1 | - |")


def test_bench_serve_refuses(suite: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench-serve", "--concurrency", "1,x", "--suite", str(suite)]) == 2
    assert main(["bench-serve", "--url", "http://127.0.0.1:1", "--target", "t", "--suite", str(suite)]) == 2
    assert main(["bench-serve", "--url", "http://127.0.0.1:1", "--suite", str(suite), "--requests", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("verispec: error: ") for line in err)
    assert "--concurrency" in err[0] and "--url" in err[1] and "--requests" in err[2]
