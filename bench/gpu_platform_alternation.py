"""The alternation of `bench/gpu_platform.py`: its scripted requests to the served platform, one at
a time, each streamed through the ``openai`` client and timed to its first chunk, and what the
status said around each (split from there). `describe_try` says what answered a request -- the
same instance woken, or a new one and the tier it came from -- from the model's instance before
and after it (`big_instance`); the checks and the JSON line are built from these tries in
`bench/gpu_platform.py`.
"""

from __future__ import annotations

import time
from typing import Any

from bench.coldstart import wait_for
from bench.gpu_common import log
from bench.gpu_platform_setup import (ASLEEP, BENCH, COLD, DRAM, FILL, REQUEST_DEADLINE_S, SETUP, SMALL,
                                      PlatformMode)
from bench.served_platform import ServedPlatform

POLL_S = 0.2
DRAM_COPY_TIMEOUT_S = 120.0


def big_instance(status: dict[str, Any], model_id: str) -> dict[str, Any] | None:
    """The model's one instance that is not stopping (None: it has none)."""
    mine = [i for i in status.get("instances", []) if i["model_id"] == model_id and i["state"] != "stopping"]
    return mine[0] if mine else None


def describe_try(before: dict[str, Any] | None, after: dict[str, Any] | None, wakes_moved: bool,
                 placed_tier: str | None) -> dict[str, Any]:
    """What answered a request, from the model's instance before and after it: the same one woken
    (``woke``), or a new one (``new_instance``, with the tier placement chose and it loaded from)."""
    new = after is not None and (before is None or before["instance_id"] != after["instance_id"])
    return {"instance_id": after["instance_id"] if after else None, "state_before": before["state"] if before else None,
            "woke": bool(before is not None and before["state"] == "asleep" and not new and wakes_moved),
            "new_instance": new, "placed_tier": placed_tier if new else None,
            "tier": after.get("tier") if new and after else None,
            "load_s": after.get("load_s") if new and after else None}


class Alternation:
    """The scripted requests, one at a time, and what the status said around each."""

    def __init__(self, platform: ServedPlatform, mode: PlatformMode, big_id: str, small_ids: list[str],
                 deadline: float) -> None:
        import openai

        self.platform, self.mode, self.big_id, self.small_ids = platform, mode, big_id, small_ids
        self.deadline = deadline  # time.monotonic() past which the sequence stops where it is
        self.dram_copy_timeout_s = DRAM_COPY_TIMEOUT_S
        self.big_name = big_id.split("/")[1]  # also its repository name (deployed from <repository>/<name>)
        self.client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key="none", max_retries=0,
                                    timeout=REQUEST_DEADLINE_S)
        self.prompt = [3 + (i * 7919) % 997 for i in range(mode.prompt_tokens)]  # ids in the tokenizer's range
        self.tries: list[dict[str, Any]] = []
        self.max_used: dict[str, int] = {}  # node memory field -> the most seen in use
        self.counts_at_start = self.counts(self.status())

    def time_left(self, cap_s: float) -> float:
        """`cap_s`, or less where the time limit is nearer; TimeoutError once it has passed."""
        left_s = self.deadline - time.monotonic()
        if left_s <= 0:
            raise TimeoutError("the time limit (--time-limit-s) was reached")
        return min(cap_s, left_s)

    def status(self) -> dict[str, Any]:
        status = self.platform.status()
        for node in status.get("nodes", []):
            for key, value in node.items():
                if isinstance(value, dict) and "used_bytes" in value and "budget_bytes" in value:
                    self.max_used[key] = max(self.max_used.get(key, 0), value["used_bytes"])
        return status

    @staticmethod
    def counts(status: dict[str, Any]) -> dict[str, int]:
        return dict(status.get("slot_sharing", {}).get("counts", {}))

    def counts_delta(self, status: dict[str, Any]) -> dict[str, int]:
        now = self.counts(status)
        return {k: v - self.counts_at_start.get(k, 0) for k, v in now.items()}

    def first_token(self, model_id: str) -> tuple[float | None, str | None]:
        """(seconds from the call to the first streamed chunk, the failure or None)."""
        import openai

        start = time.perf_counter()
        ttft_s, finish = None, None
        try:
            client = self.client.with_options(timeout=self.time_left(REQUEST_DEADLINE_S))
            stream = client.completions.create(model=model_id, prompt=self.prompt, max_tokens=self.mode.max_tokens,
                                                    temperature=0.0, stream=True, logprobs=0,
                                                    extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices:
                    ttft_s = time.perf_counter() - start if ttft_s is None else ttft_s
                    finish = chunk.choices[0].finish_reason or finish
        except openai.OpenAIError as exc:
            return ttft_s, f"{type(exc).__name__}: {str(exc)[:160]}"
        if ttft_s is None:
            return None, "no-output"
        return (ttft_s, None) if finish in ("length", "stop") else (ttft_s, f"finish-{finish}")

    def request(self, model_id: str, phase: str, **extra: Any) -> dict[str, Any]:
        status = self.status()
        before = big_instance(status, self.big_id)
        hosts_before = status.get("hosts", [])
        wakes, evictions = self.counts(status).get("wakes", 0), self.counts(status).get("evictions", 0)
        ttft_s, failure = self.first_token(model_id)
        status = self.status()
        record: dict[str, Any] = {"phase": phase, "model_id": model_id, "ttft_s": ttft_s, "failure": failure, **extra}
        if model_id == self.big_id:
            after = big_instance(status, self.big_id)
            placed = next((d.get("tier") for d in reversed(status.get("recent_decisions", []))
                           if d.get("kind") == "placement" and after and d.get("instance_id") == after["instance_id"]),
                          None)
            record.update(describe_try(before, after, self.counts(status).get("wakes", 0) > wakes, placed))
            record["evictions_during"] = self.counts(status).get("evictions", 0) - evictions
            if phase == COLD:
                record["host_was_empty"] = bool(hosts_before) and all(not h["instances"] for h in hosts_before)
        self.tries.append(record)
        shown = "failed: " + failure if failure else f"{ttft_s:.3f} s"
        log(BENCH, f"{phase} {model_id}: {shown}" + "".join(
            f", {k} {record[k]}" for k in ("woke", "new_instance", "placed_tier", "tier", "load_s", "evictions_during",
                                           "sleeper_stopped_before", "in_dram_before") if k in record))
        return record

    def wait_big_asleep(self) -> None:
        def asleep() -> bool:
            instance = big_instance(self.status(), self.big_id)
            if instance is None:
                raise RuntimeError(f"{self.big_id} was stopped while idle instead of put to sleep")
            return instance["state"] == "asleep"

        wait_for(asleep, f"{self.big_id} to fall asleep", self.time_left(self.mode.big_keep_alive_s + 120.0), POLL_S)

    def fill_until_big_stopped(self) -> bool:
        """Asks the 1Bs in turn until the 8B's sleeper is stopped (True) or every 1B is resident
        beside it and it still sleeps (False)."""
        for _ in range(2):
            for small_id in self.small_ids:
                self.request(small_id, FILL)
                if big_instance(self.status(), self.big_id) is None:
                    return True
            status = self.status()
            resident = {i["model_id"] for i in status.get("instances", []) if i["state"] in ("ready", "loading")}
            if resident >= set(self.small_ids):
                return False
        return big_instance(self.status(), self.big_id) is None

    def in_dram(self) -> bool:
        """Waits (bounded) for the 8B's checkpoint in a node's DRAM tier: the controller copies a
        model there once the node has settled after its start; False if it did not show (later
        waits are then short: a copy that did not come once is not waited for again)."""
        def there() -> bool:
            return any(e["model"] == self.big_name for n in self.status().get("nodes", []) for t in n.get("tiers", [])
                       if t["tier"] == "dram" for e in t["entries"])
        try:
            return wait_for(there, f"{self.big_name} in the DRAM tier", self.time_left(self.dram_copy_timeout_s),
                            POLL_S)
        except TimeoutError as exc:
            self.time_left(1.0)  # the time limit: the sequence stops
            log(BENCH, f"going on without: {exc}")
            self.dram_copy_timeout_s = POLL_S
            return False

    def run(self) -> None:
        self.request(self.big_id, COLD)
        self.in_dram()  # while the 8B is ready (its keep-alive outlasts the node's settling)
        for small_id in self.small_ids:
            self.request(small_id, SMALL)
        self.request(self.big_id, SETUP)  # resident again, so its wakes find room
        for _ in range(self.mode.repeats):
            if big_instance(self.status(), self.big_id) is None:
                self.request(self.big_id, SETUP)
            self.wait_big_asleep()
            self.request(self.big_id, ASLEEP)
        for _ in range(self.mode.repeats):
            self.wait_big_asleep()
            stopped = self.fill_until_big_stopped()
            self.request(self.big_id, DRAM, sleeper_stopped_before=stopped, in_dram_before=self.in_dram())
