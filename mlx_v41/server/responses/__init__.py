"""OpenAI's Responses API: request models (protocol.py), events and the response object
(events.py), stored responses for `previous_response_id` (store.py), routes."""
