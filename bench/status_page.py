"""What the status page costs the agent, and how fast the API answers over a million verdicts (issue 14).

Real runs on this machine; nothing simulated.

(a) Page cost.  The demo line A agent (its zoo, `coe-agent demo --line A`
    builds it, and a recording drawn as the demo's is, 3,000 frames by default)
    runs in this process and serves full-rate replays (as fast as acked, the
    demo's rate).  The replay client is
    a child process and the page runs in headless Chromium, so this process's
    CPU is the agent's.  Runs alternate: without a page, then with the page
    open (live over server-sent events), `--pairs` times.

      agent CPU s      user + system seconds of this process while the frames are served
      page threads s   CPU of the threads that exist for the page: the status sampler, the HTTP
                       accept loop and every request handler (event stream, files, thumbnails),
                       read per thread from /proc (schedstat, ns)
      page share       page threads / agent CPU                                   target <= 2%
      with vs without  agent CPU per frame with the page over without (noisy: the page's share
                       is the precise figure; this one checks it from outside)

(b) Query time.  A results database with 1,000,000 verdicts (24 component types,
    boards of 20 frames, 10% defects, 0.1% errors, one frame every 4 ms) is
    written once under var/bench/ and queried through the real HTTP server
    (`/api/verdicts`, a kept-alive connection as a browser holds) and through
    the library call the CLI makes.  `cold`: the first call after the file was
    dropped from the page cache; `p50`/`max`: over `--repeats` warm calls.
                                                                              target <= 100 ms

Usage:  python bench/status_page.py [--pairs 3] [--frames 3000] [--repeats 20] [--skip-page] [--skip-query]
        [--screenshot PATH]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = 1_000_000
COMPONENTS = [f"C{i:02d}" for i in range(24)]


# -- (a) page cost --------------------------------------------------------------------------
def _thread_cpu_ns(native_id: int) -> int | None:
    try:
        return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        try:
            fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None


def _page_thread(t: threading.Thread) -> bool:
    return t.name in ("status-sampler", "status-http") or "process_request_thread" in t.name


class PageThreads:
    """Polls the page's threads' CPU while a run lasts (request handlers come and go)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, int]] = {}     # native id -> (first, last) CPU ns
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, name="bench-poll", daemon=True)

    def _poll(self) -> None:
        for t in threading.enumerate():
            if _page_thread(t) and t.native_id is not None:
                ns = _thread_cpu_ns(t.native_id)
                if ns is not None:
                    first = self.seen.get(t.native_id, (ns, ns))[0]
                    self.seen[t.native_id] = (first, ns)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._poll()

    def start(self) -> "PageThreads":
        self._poll()
        self._t.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        self._poll()
        return sum(last - first for first, last in self.seen.values()) / 1e9


def browser_child(url: str) -> int:
    """Open the page, say 'ready' once it has shown live data, keep it open until stdin closes."""
    from playwright.sync_api import sync_playwright

    exe = os.environ.get("COE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = b.new_page(viewport={"width": 1920, "height": 1080})     # a shop-floor monitor
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(url)
        for _ in range(300):
            if page.inner_text("#conn-text") == "live":
                break
            page.wait_for_timeout(100)
        print("ready", flush=True)
        for line in sys.stdin:    # 'shot PATH' takes a screenshot; the parent closes stdin when the run is over
            if line.startswith("shot "):
                page.screenshot(path=line[5:].strip(), full_page=True)
        print(json.dumps({"console_errors": errors}), flush=True)
        b.close()
    return 0


def one_run(cfg_base, rec_dir: Path, work: Path, *, page: bool, frames: int, shot: str | None = None,
            shot_after: float = 6.0) -> dict:
    from edge_agent.agent import Agent

    from storage.recording import Recording

    shutil.rmtree(work, ignore_errors=True)
    cfg = cfg_base.model_copy(update={
        "results_db": str(work / "results.db"), "ingest": "router+bind:tcp://127.0.0.1:*",
        "publish": "pub+bind:tcp://127.0.0.1:*", "metrics": cfg_base.metrics.model_copy(update={"port": 0})})
    n = min(frames, len(Recording(rec_dir)))
    agent = Agent(cfg).start()
    browser = None
    try:
        if page:
            browser = subprocess.Popen([sys.executable, __file__, "--browser", f"http://127.0.0.1:{agent.metrics_port}/"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if browser.stdout.readline().strip() != "ready":
                raise RuntimeError("the browser did not open the page")
            if shot:     # mid-run, while frames flow: what the line's monitor shows
                def take(b=browser) -> None:
                    try:
                        b.stdin.write(f"shot {shot}\n")
                        b.stdin.flush()
                    except (ValueError, OSError):
                        print("screenshot: the run ended first; use more --frames", file=sys.stderr)
                threading.Timer(shot_after, take).start()
        time.sleep(1.0)
        poll = PageThreads().start()
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        code = (f"from edge_agent.replay import send_messages, recording_messages; "
                f"from storage.recording import Recording; import itertools, json; "
                f"r = send_messages(itertools.islice(recording_messages(Recording({str(rec_dir)!r})), {n}), "
                f"{agent.endpoints['ingest']!r}); print(json.dumps({{'accepted': r.accepted}}))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
        accepted = json.loads(out.stdout.strip().splitlines()[-1])["accepted"]
        if not agent.wait_verdicts(accepted, timeout=600):
            raise RuntimeError("verdicts missing")
        r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        page_s = poll.stop()
        errors = []
        if browser is not None:
            got, _ = browser.communicate("", timeout=60)
            errors = json.loads(got.strip().splitlines()[-1])["console_errors"]
            browser = None
    finally:
        if browser is not None:
            browser.kill()
        agent.stop()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"page": page, "frames": accepted, "seconds": round(w1 - w0, 2), "fps": round(accepted / (w1 - w0), 1),
            "agent_cpu_s": round(cpu, 3), "page_threads_s": round(page_s, 4),
            "page_share": round(page_s / cpu, 5) if cpu else None, "console_errors": errors}


def page_cost(pairs: int, frames: int, shot: str | None) -> dict:
    from edge_agent.config import find_config, load_config

    from coe import load_spec
    from storage.expert_store import ExpertStore

    from edge_agent.demo import ensure_recording

    cfg = load_config(find_config("A"))
    model = load_spec(cfg.spec_path)
    store = ExpertStore(cfg.store_path)
    if any(not store.has(e) for e in model.experts):
        raise SystemExit(f"{cfg.store_path} lacks the demo zoo: run `coe-agent demo --line A` once first")
    # the demo's recording when it is long enough; else a longer one drawn the same way (seed 7), kept for reuse
    rec = ensure_recording(cfg, model, 600, 0, quiet=True) if frames <= 600 else \
        ensure_recording(cfg, model, frames, 7, quiet=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        one_run(cfg, rec, Path(tmp) / "warm", page=False, frames=min(frames, 100))     # warm caches, not counted
        for i in range(pairs):
            for page in (False, True):
                runs.append(one_run(cfg, rec, Path(tmp) / f"run{i}{page}", page=page, frames=frames,
                                    shot=shot if page and i == pairs - 1 else None))
                r = runs[-1]
                print(f"  run {i + 1}{' page' if page else '     '}: {r['frames']} frames in {r['seconds']} s "
                      f"({r['fps']}/s), agent CPU {r['agent_cpu_s']} s, page threads {r['page_threads_s']} s",
                      file=sys.stderr)
    with_page = [r for r in runs if r["page"]]
    without = [r for r in runs if not r["page"]]
    per_frame = lambda rs: statistics.mean(r["agent_cpu_s"] / r["frames"] for r in rs)  # noqa: E731
    # each pair ran back to back: their ratio is less exposed to whatever else the machine did meanwhile
    pair_ratios = [(w["agent_cpu_s"] / w["frames"]) / (o["agent_cpu_s"] / o["frames"]) - 1
                   for o, w in zip(without, with_page)]
    return {"runs": runs, "with_vs_without_pairs": [round(x, 4) for x in pair_ratios],
            "with_vs_without_median": round(statistics.median(pair_ratios), 4), "page_share_mean": round(statistics.mean(r["page_share"] for r in with_page), 5),
            "page_share_max": round(max(r["page_share"] for r in with_page), 5),
            "idle_share_mean": round(statistics.mean(r["page_share"] for r in without), 5),
            "cpu_per_frame_ms_without": round(1000 * per_frame(without), 3),
            "cpu_per_frame_ms_with": round(1000 * per_frame(with_page), 3),
            "with_vs_without": round(per_frame(with_page) / per_frame(without) - 1, 4),
            "console_errors": sum(len(r["console_errors"]) for r in with_page)}


# -- (b) query time ---------------------------------------------------------------------------------
def build_db(path: Path, rows: int = ROWS) -> dict:
    """1M frames and verdicts, written straight into the schema the agent uses (its indexes included)."""
    from storage.results import ResultStore

    if path.exists():
        rs = ResultStore(path, readonly=True)
        n = rs.db.execute("SELECT count(*) FROM verdicts").fetchone()[0]
        rs.close()
        if n == rows:
            return {"rows": n, "built": False}
        for p in path.parent.glob(path.name + "*"):
            p.unlink()
    rs = ResultStore(path)
    rng = random.Random(14)
    t0 = 1.7e9
    conn = rs.db.conn
    conn.execute("BEGIN")
    batch_f, batch_v = [], []
    for i in range(rows):
        comp = COMPONENTS[rng.randrange(len(COMPONENTS))]
        board = f"B{i // 20:06d}"
        at = t0 + i * 0.004
        u = rng.random()
        verdict = "error" if u < 0.001 else "defect" if u < 0.101 else "pass"
        fid = f"A-{board}-{i % 20:03d}"
        batch_f.append((fid, "A", board, comp, at, at, "done"))
        batch_v.append((fid, verdict, "cls: missing (0.93)" if verdict == "defect" else "", at + 0.05, 50.0,
                        '["cls-x", "det-y"]', '{"cls-x": 1, "det-y": 1}', comp, board))
        if len(batch_f) == 50_000:
            conn.executemany("INSERT INTO frames (frame_id, line, board_id, component, ts, received_at, status) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)", batch_f)
            conn.executemany("INSERT INTO verdicts (frame_id, verdict, reason, decided_at, latency_ms, chain, "
                             "versions, component, board_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", batch_v)
            batch_f, batch_v = [], []
    if batch_f:
        conn.executemany("INSERT INTO frames VALUES (?, ?, ?, ?, ?, ?, ?)", batch_f)
        conn.executemany("INSERT INTO verdicts (frame_id, verdict, reason, decided_at, latency_ms, chain, "
                         "versions, component, board_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", batch_v)
    conn.commit()
    rs.close()
    return {"rows": rows, "built": True}


def query_time(repeats: int) -> dict:
    from edge_agent.status_server import StatusServer
    from prometheus_client import CollectorRegistry
    from storage.pagecache import drop_from_page_cache
    from storage.queries import parse_verdict_params, query_verdicts, verdict_sql
    from storage.results import ResultStore

    db = ROOT / "var" / "bench" / "status-1m" / "results.db"
    t = time.perf_counter()
    built = build_db(db)
    built["seconds"] = round(time.perf_counter() - t, 1)
    built["megabytes"] = round(sum(p.stat().st_size for p in db.parent.glob("results.db*")) / 1e6, 1)
    last = 1.7e9 + ROWS * 0.004
    queries = {
        "newest 50": "limit=50",
        "defects": "verdict=defect&limit=50",
        "errors (0.1%)": "verdict=error&limit=50",
        "one component": "component=C07&limit=50",
        "one board": f"board=B{ROWS // 40:06d}&limit=50",
        "defects of a component": "verdict=defect&component=C07&limit=50",
        "errors of a component": "verdict=error&component=C07&limit=50",
        "component on a board": f"component=C07&board=B{ROWS // 40:06d}&limit=50",
        "last 10 min of defects": f"verdict=defect&since={last - 600:.0f}&limit=50",
        "a component, 1000 rows": "component=C03&limit=1000",
        "no match": "component=NOPE&limit=50",
    }
    server = StatusServer("127.0.0.1", 0, registry=CollectorRegistry(), model=None, db_path=db).start()
    rs = ResultStore(db, readonly=True)
    rows = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)

        def http_get(q: str) -> dict:
            conn.request("GET", "/api/verdicts?" + q)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{q}: HTTP {resp.status} {body[:200]!r}")
            return json.loads(body)

        # a deep page: the 20th page of one component, by following `next`
        q = "component=C07&limit=50"
        for _ in range(19):
            q = "component=C07&limit=50&next=" + http_get(q)["next"]
        queries["20th page of a component"] = q
        for name, q in queries.items():
            drop_from_page_cache(db)
            t = time.perf_counter()
            doc = http_get(q)
            cold = (time.perf_counter() - t) * 1000
            warm = []
            for _ in range(repeats):
                t = time.perf_counter()
                http_get(q)
                warm.append((time.perf_counter() - t) * 1000)
            params = {k: [v] for k, v in (kv.split("=", 1) for kv in q.split("&"))}
            vq = parse_verdict_params(params)
            lib = []
            for _ in range(repeats):
                t = time.perf_counter()
                query_verdicts(rs.db.conn, vq)
                lib.append((time.perf_counter() - t) * 1000)
            sql, args = verdict_sql(rs.db.conn, vq)
            plan = " | ".join(r[3] for r in rs.db.execute("EXPLAIN QUERY PLAN " + sql, args))
            rows.append({"query": name, "params": q, "rows": len(doc["rows"]), "cold_ms": round(cold, 2),
                         "http_p50_ms": round(statistics.median(warm), 2), "http_max_ms": round(max(warm), 2),
                         "library_p50_ms": round(statistics.median(lib), 2), "plan": plan})
        conn.close()
    finally:
        rs.close()
        server.close()
    return {"database": built, "queries": rows, "worst_warm_ms": max(r["http_max_ms"] for r in rows),
            "worst_cold_ms": max(r["cold_ms"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--frames", type=int, default=3000, help="frames per run (more than 600: a longer recording)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-page", action="store_true")
    ap.add_argument("--skip-query", action="store_true")
    ap.add_argument("--screenshot", help="save the page as it looks 6 s into the last run with it open")
    ap.add_argument("--browser", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.browser:
        return browser_child(args.browser)
    os.chdir(ROOT)
    from edge_agent.cli import quiet_third_party

    quiet_third_party()
    out: dict = {"bench": "status_page", "real_run": True, "cores": os.cpu_count()}
    if not args.skip_page:
        print(f"(a) page cost: line A demo agent, full-rate replays of {args.frames} frames, "
              f"{args.pairs} pairs without/with the page open", file=sys.stderr)
        out["page"] = page_cost(args.pairs, args.frames, args.screenshot)
        p = out["page"]
        print("\n(a) the page's cost to the agent (real run, this machine)")
        print(f"{'run':<12}{'frames':>8}{'frames/s':>10}{'agent CPU s':>13}{'page threads s':>16}{'share':>9}")
        for i, r in enumerate(p["runs"]):
            print(f"{(str(i // 2 + 1) + (' page' if r['page'] else ' no page')):<12}{r['frames']:>8}{r['fps']:>10}"
                  f"{r['agent_cpu_s']:>13}{r['page_threads_s']:>16}{100 * r['page_share']:>8.2f}%")
        print(f"page threads' share of the agent's CPU with the page open: mean {100 * p['page_share_mean']:.2f}%, "
              f"max {100 * p['page_share_max']:.2f}% (target <= 2%); without a page "
              f"{100 * p['idle_share_mean']:.2f}%")
        print(f"agent CPU per frame: {p['cpu_per_frame_ms_without']} ms without, {p['cpu_per_frame_ms_with']} ms "
              f"with the page ({100 * p['with_vs_without']:+.1f}%); pair by pair "
              f"{', '.join(f'{100 * x:+.1f}%' for x in p['with_vs_without_pairs'])} (median "
              f"{100 * p['with_vs_without_median']:+.1f}%); console errors: {p['console_errors']}")
    if not args.skip_query:
        print("building / opening the 1,000,000-verdict database ...", file=sys.stderr)
        out["query"] = query_time(args.repeats)
        q = out["query"]
        print(f"\n(b) /api/verdicts over {q['database']['rows']:,} verdicts ({q['database']['megabytes']} MB; "
              f"{'built in ' + str(q['database']['seconds']) + ' s' if q['database']['built'] else 'reused'})")
        print(f"{'query':<28}{'rows':>6}{'cold ms':>9}{'HTTP p50':>10}{'HTTP max':>10}{'library p50':>13}  index")
        for r in q["queries"]:
            idx = next((w for w in r["plan"].split() if w.startswith("idx_")), r["plan"][:30])
            print(f"{r['query']:<28}{r['rows']:>6}{r['cold_ms']:>9}{r['http_p50_ms']:>10}{r['http_max_ms']:>10}"
                  f"{r['library_p50_ms']:>13}  {idx}")
        print(f"worst warm {q['worst_warm_ms']} ms, worst cold {q['worst_cold_ms']} ms (target <= 100 ms)")
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
