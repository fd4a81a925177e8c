"""Stored responses for GET/DELETE /v1/responses/{id}, input_items and previous_response_id: in memory,
bounded (least recently used dropped first), each visible only to the API key that created it.

Holds finished response objects and their input items; knows nothing of the engine or of HTTP.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_CHAIN_TURNS = 256  # turns one previous_response_id chain may have (agent loops run long, but not forever)


@dataclass(slots=True)
class StoredResponse:
    response: dict  # the response object as returned
    input_items: list[dict]  # this request's own input items, with ids
    previous: StoredResponse | None  # the turn it continued; kept alive by this link even once evicted
    api_key: str | None  # None when the server runs without keys
    num_turns: int = 1  # this turn and every earlier one in its chain

    def __post_init__(self) -> None:
        if self.previous is not None:
            self.num_turns = self.previous.num_turns + 1

    def conversation(self) -> list[dict]:
        """Every item of the chain, oldest first: each turn's input, then its output."""
        turns = []
        record: StoredResponse | None = self
        while record is not None:
            turns.append(record)
            record = record.previous
        items: list[dict] = []
        for turn in reversed(turns):
            items += turn.input_items
            items += turn.response["output"]
        return items


class ResponseStore:
    """id -> StoredResponse, at most `capacity` of them. A chain holds its earlier turns alive through
    `previous`, so continuing a conversation never finds a hole; chains are at most MAX_CHAIN_TURNS long, so
    the store holds at most capacity x MAX_CHAIN_TURNS records whatever is evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        rid = record.response["id"]
        self._records[rid] = record
        self._records.move_to_end(rid)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, rid: str, api_key: str | None) -> StoredResponse | None:
        """The record, or None when it is unknown, evicted, deleted or another key's."""
        record = self._records.get(rid)
        if record is None or record.api_key != api_key:
            return None
        self._records.move_to_end(rid)
        return record

    def delete(self, rid: str, api_key: str | None) -> bool:
        if self.get(rid, api_key) is None:
            return False
        del self._records[rid]
        return True
