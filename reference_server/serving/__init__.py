"""The OpenAI-compatible HTTP front end over an engine: routes, request parsing, response bodies,
server-sent events, the chat template."""
