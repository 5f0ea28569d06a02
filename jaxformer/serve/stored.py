"""The Responses API's stored responses: OpenAI's `store` and `previous_response_id`, and the routes that
read them back (`GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`).

Kept in the server's memory, the most recent `capacity` of them (`jaxformer serve --responses-store N`; the
oldest is forgotten first, and a restart forgets all), each with the whole conversation it answered: its
previous response's conversation and output, then its own input. A request that names a previous response
continues that conversation, as OpenAI's does: its input follows the previous response's output, and only
its own `instructions` apply. One made in the background and streamed keeps its stream's events too, to be
read again from any of them (`GET /v1/responses/{id}?stream=true&starting_after=N`: `stream_query`).
"""

from __future__ import annotations

import collections
import re
import secrets
from typing import TYPE_CHECKING, NamedTuple

from jaxformer.serve.protocol import APIError, bad

if TYPE_CHECKING:
    from jaxformer.serve.responses import Events

# The prefix of an input item's id, by its type (an item given without one gets one, as OpenAI's do).
_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}
MAX_LIMIT = 100  # input_items: at most this many a page, as OpenAI's
# Background streams whose events are kept to be read again, the most recent (~200 bytes an event, about one a
# token: a 4,000-token answer's are ~1 MB). An older one's Response stays stored; its events are dropped.
STREAMS_KEPT = 100


class Stored(NamedTuple):
    """One stored response.

    Attributes:
        response: the Response object, as it was answered.
        items: the input items it answered, in order: those of the conversation before it, then its own.
        events: its stream's events (`responses.Events`), kept where it was made in the background and
            streamed, to be read again (`stream_query`); None otherwise.
    """

    response: dict
    items: list[dict]
    events: Events | None = None


def input_items(given: str | list) -> list[dict]:
    """A request's `input` as input items, each with an id: a string is a user message of one text part.

    Args:
        given: the request's `input` (checked: a string or a list of items).

    Returns:
        The items, each a copy with an "id" where it had none.
    """
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    kind = lambda item: item.get("type", "message")
    return [{"id": _PREFIX.get(kind(item), "item_") + secrets.token_hex(12)} | item | {"type": kind(item)}
            for item in given]  # fmt: skip


class Store:
    """The responses kept, the most recent `capacity` (0: none, and a request may name no previous one).

    Args:
        capacity: how many responses to keep.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._kept: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._streams: collections.deque[str] = collections.deque()  # those kept with their events, oldest first

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: dict, items: list[dict], events: Events | None = None) -> None:
        """Keep a response (in place of the one of its id, whose stream's events it keeps), forgetting the oldest
        beyond the capacity, and the events of background streams beyond the last STREAMS_KEPT.

        Args:
            response: the Response object answered.
            items: the conversation it answered (`conversation`'s, then its own input's `input_items`).
            events: its stream's events, where it is made in the background and streamed.
        """
        if self.capacity == 0:
            return
        before = self._kept.get(response["id"])
        events = before.events if events is None and before is not None else events
        self._kept[response["id"]] = Stored(response, items, events)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
        if events is not None and before is None:
            self._streams.append(response["id"])
            while len(self._streams) > STREAMS_KEPT:
                if (rid := self._streams.popleft()) in self._kept:
                    self._kept[rid] = self._kept[rid]._replace(events=None)

    def get(self, rid: str, param: str | None = None) -> Stored:
        """A stored response.

        Args:
            rid: its id.
            param: the request field that named it (None: the path).

        Returns:
            It.

        Raises:
            APIError: none of that id is kept (a 404; a 400 where nothing is ever kept).
        """
        if param is not None and self.capacity == 0:
            raise bad(param, "this server keeps no responses (started with --responses-store 0): send the whole "
                      "conversation as input", "unsupported")  # fmt: skip
        if not isinstance(rid, str) or rid not in self._kept:
            what = "previous response" if param else "response"
            raise APIError(404, f"no {what} with id {str(rid)[:80]!r} is kept here (the server keeps its last "
                           f"{self.capacity} stored responses)", param, "not_found")  # fmt: skip
        return self._kept[rid]

    def conversation(self, rid: str) -> list[dict]:
        """What a request that names `rid` as its previous response continues: that response's conversation,
        then its output.

        Args:
            rid: the request's `previous_response_id`.

        Returns:
            The items.

        Raises:
            APIError: no response of that id is kept.
        """
        if not isinstance(rid, str):
            raise bad("previous_response_id", f"a string is expected, got {type(rid).__name__}", "invalid_type")
        kept = self.get(rid, "previous_response_id")
        return kept.items + kept.response["output"]

    def delete(self, rid: str) -> dict:
        """Forget a response (`DELETE /v1/responses/{id}`).

        Args:
            rid: its id.

        Returns:
            OpenAI's answer: {"id", "object": "response", "deleted": true}.

        Raises:
            APIError: none of that id is kept.
        """
        self.get(rid)
        del self._kept[rid]
        return {"id": rid, "object": "response", "deleted": True}

    def listing(self, rid: str, query: dict) -> dict:
        """The input items a response answered (`GET /v1/responses/{id}/input_items`), a page of them: newest
        first unless `order=asc`, `limit` of them (default 20, at most 100), those after the item `after`.

        Args:
            rid: the response's id.
            query: the request's query parameters.

        Returns:
            OpenAI's list object: {"object": "list", "data", "first_id", "last_id", "has_more"}.

        Raises:
            APIError: none of that id is kept, or a query parameter is malformed.
        """
        items = self.get(rid).items
        _known(query, ("order", "limit", "after"), ("include",))
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad("order", f"'asc' or 'desc' is expected, got {order[:20]!r}")
        limit = query.get("limit", "20")
        if not (limit.isdigit() and 1 <= int(limit) <= MAX_LIMIT):
            raise bad("limit", f"an integer in [1, {MAX_LIMIT}] is expected, got {limit[:20]!r}")
        items = items if order == "asc" else items[::-1]
        if "after" in query:
            ids = [item["id"] for item in items]
            if query["after"] not in ids:
                raise bad("after", f"no input item {query['after'][:80]!r} in this response")
            items = items[ids.index(query["after"]) + 1 :]
        page = items[: int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}  # fmt: skip


def stream_query(kept: Stored, query: dict) -> int | None:
    """What `GET /v1/responses/{id}` asks of a stored response: None, the Response (no `stream`, or
    `stream=false`); or the sequence number after which to stream its events (`starting_after`, -1 where
    not given), where it was made in the background and streamed, as OpenAI's can be read again.

    Args:
        kept: the stored response.
        query: the request's query parameters.

    Returns:
        None, or the sequence number.

    Raises:
        APIError: a query parameter is unknown or malformed, or the response has no stream to read.
    """
    _known(query, ("stream", "starting_after"), ("include", "include_obfuscation"))
    stream = query.get("stream", "false")
    if stream not in ("true", "false"):
        raise bad("stream", f"'true' or 'false' is expected, got {stream[:20]!r}")
    after = query.get("starting_after", "-1")
    if re.fullmatch(r"-1|[0-9]+", after) is None:
        raise bad("starting_after", f"an event's sequence number (an integer >= 0) is expected, got {after[:20]!r}")
    if stream == "false":
        if "starting_after" in query:
            raise bad("starting_after", "only a stream starts after an event: add stream=true")
        return None
    if kept.events is None:
        raise bad("stream", f"response {kept.response['id']!r} has no stream to read again: only one made with "
                  f"background and stream has, among the last {STREAMS_KEPT} such", "unsupported")  # fmt: skip
    return int(after)


def _known(query: dict, read: tuple[str, ...], taken: tuple[str, ...]) -> None:
    """Refuse a query parameter neither `read` nor `taken` (taken and ignored: OpenAI's client may send it)."""
    if unknown := sorted(set(query) - set(read) - set(taken)):
        raise bad(unknown[0], f"unknown query parameter: {', '.join(read)} are known", "unknown_parameter")
