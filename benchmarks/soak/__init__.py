"""Bounded soak: mixed traffic against one real CPU server for a fixed time, a disk fault midway.

One SmolLM2-135M-Instruct server (fp32, `--radix-cache-backend hicache_ext`, HiCache host tier,
our TTL disk tier with a small capacity and a short TTL period, a small device
pool and a small chunked-prefill size). For `--minutes`, `--workers` client threads send a
weighted mix of requests (`workload.py`, `traffic.py`), each with a timeout:

- `register`: `POST /chunks` of HotpotQA paragraphs (new ones over time, and repeats);
- `fused`: `/generate` with `custom_params.fusion`, selectors cycling a3/freq/cacheblend/epic/reuse,
  2-6 registered paragraphs in shuffled order + a question (the longer ones are split by chunked
  prefill and fall back to the normal prefill);
- `normal_shared`: a long shared system prefix + one of a few record sets (tree/host/disk hits);
- `normal_long`: ~0.9-2K tokens, split across chunked-prefill rounds;
- `stream`, `logprob` (fused or normal), `abort` (streaming, the client closes the connection
  after the first chunks: counted as `aborted`, deliberate);
- `delete` (`DELETE /chunks/{id}`), `bad` (malformed requests, a 4xx is expected), `list`
  (`GET /chunks`), `storage` (`GET /hicache_ext/storage`).

An admin thread (`run.py`, calls in `admin.py`) re-plans the TTLs
(`POST /hicache_ext/storage/ttl {"replan": true}`) and reads `GET /chunks` /
`GET /hicache_ext/storage` periodically. At 50 % of the duration it injects a storage fault from
outside the server (`fault.py`): new requests are held until none is in flight; two shared-prefix
prompts, sent alone after `/flush_cache`, show which disk pages they use; a few page files under
the disk dir get bytes flipped in their payload (one of them in the first prompt's pages) and one
page subdirectory is deleted (one of the second prompt's pages); both prompts are sent again, each
alone after a flush, so the damage is read at once (the store must drop it and count it:
`disk.corrupt_pages`, `io_errors`); then traffic resumes.

A monitor thread (`monitor.py`) samples the RSS of the server's process group (psutil) and checks
the process and `/health` every `--sample-s` seconds; an exited server or 3 failed health checks
in a row is a crash and ends the run (the log tail goes into the JSON).

Output: JSON (`--out`, default benchmarks/results/soak.json, `summary.py`) and a PNG next to it
(`plot.py`: RSS and request latency over time, fault marked). Acceptance (issue 11): 0 crashes;
RSS growth over the last 10 minutes (the last half for shorter runs) < 5 %, measured as the
median RSS of the last minute of that window over the median of its first minute (samples taken
while the fault held the traffic left out); every request answered or refused with a clear
status (no 5xx, no connection error except the deliberate aborts, no timeout). Exit status 1
when any of them fails.

    python -m benchmarks.soak --minutes 20     (from the repository root)
"""
