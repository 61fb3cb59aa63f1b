"""The Responses API's stored responses: each response body with its whole conversation as
input items (its previous response's, its own input, its output), so that a request naming it
as `previous_response_id` renders the earlier prompt and reply again, token for token. An LRU
bounded by count, in memory only (`--max-stored-responses`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass
class StoredResponse:
    body: dict  # the response object as it was returned
    items: list  # the conversation up to and including its output, as input item dicts


class ResponseStore:
    """The most recently created or read `max_entries` responses (0 keeps none)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES):
        self.max_entries = max_entries
        self._entries: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def get(self, response_id: str) -> Optional[StoredResponse]:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
