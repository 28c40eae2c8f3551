"""The journal of a shard's requests: every finished request (an answer or a terminal failure)
appended as one JSON line and flushed as it completes, so a killed run loses nothing and a rerun
asks only what the journal has not answered for the request it would send now.

Generation (eaglenest.stages.generate.generate) writes it; it lives outside the declared outputs, so
Snakemake never deletes it after a failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from eaglenest.client.streaming import STREAM_FIELDS

# Fields that change how an answer travels, not what is asked: a journaled answer to a body that
# differs only in these is the answer to the current request.
TRANSPORT_FIELDS = frozenset(STREAM_FIELDS)


class JournalInUseError(RuntimeError):
    """Another process holds the journal open for writing."""


def request_key(body: dict[str, Any]) -> str:
    """What was asked, as one string: the body less transport-only fields, sorted."""
    return json.dumps({k: v for k, v in body.items() if k not in TRANSPORT_FIELDS}, sort_keys=True)


def iter_journal(journal: Path) -> Iterator[dict[str, Any]]:
    """Every record of the journal in order; a torn line (a kill mid-write) is skipped."""
    if not journal.exists():
        return
    with journal.open() as lines:
        for line in lines:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def encodable(record: dict[str, Any]) -> bool:
    """Can the record be written as UTF-8? An answer journaled before answers were checked may
    hold a lone surrogate (valid JSON, no UTF-8): it is asked again, never reused, or it would
    fail the raw file on every rerun."""
    try:
        json.dumps(record, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class JournalMatch:
    """What the journal holds for the requests the current settings send."""

    reused: dict[str, dict[str, Any]]  # id -> an answer to exactly this request
    origins: dict[str, str]  # id -> why it is asked again: new, retry or settings_changed

    def counts(self) -> dict[str, int]:
        counted = Counter(self.origins.values())
        return {"journal": len(self.reused)} | {k: counted[k] for k in REASK_ORIGINS}


REASK_ORIGINS = ("new", "retry", "settings_changed")


def match_journal(journal: Path, bodies: dict[str, dict[str, Any]]) -> JournalMatch:
    """Match the journal against the request body each prompt id would be sent now.

    An answer is reused only when it answered this very request; an answer to a request that the
    settings have since changed (temperature, max_tokens, model, ...) stays in the journal but is
    asked again. A matching failure means the request is retried.
    """
    keys = {sample_id: request_key(body) for sample_id, body in bodies.items()}
    reused: dict[str, dict[str, Any]] = {}
    failed, answered_otherwise = set(), set()
    for record in iter_journal(journal):
        sample_id = record["id"]
        if sample_id not in keys or sample_id in reused:
            continue
        same_request = request_key(json.loads(record["request"])) == keys[sample_id]
        if same_request and record["error_kind"] is None and encodable(record):
            reused[sample_id] = record
        elif same_request:
            failed.add(sample_id)
        elif record["error_kind"] is None:
            answered_otherwise.add(sample_id)
    origins = {}
    for sample_id in keys.keys() - reused.keys():
        if sample_id in failed:
            origins[sample_id] = "retry"
        elif sample_id in answered_otherwise:
            origins[sample_id] = "settings_changed"
        else:
            origins[sample_id] = "new"
    return JournalMatch(reused, origins)


@contextlib.contextmanager
def open_journal(journal: Path, shard: str) -> Iterator[TextIO]:
    """The journal, open for appending by this job alone: a job of an interrupted run that is
    still alive (an orphan of a killed Snakemake) would otherwise answer the same prompts again."""
    journal.parent.mkdir(parents=True, exist_ok=True)
    with journal.open("a") as journal_file:
        try:
            fcntl.flock(journal_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalInUseError(
                f"shard {shard}: another process is writing {journal} (a generation job of an "
                "interrupted run still alive?); stop it, then rerun: nothing answered is lost"
            ) from None
        if journal_file.tell():
            with journal.open("rb") as tail:
                tail.seek(-1, 2)
                if tail.read(1) != b"\n":
                    journal_file.write("\n")  # end the line torn by a kill so the next parses
        yield journal_file
