"""Agentic episodes: the contract between a multi-turn episode and its task's world.

* ``env``: the ``Environment`` protocol (``reset`` / ``step`` / ``close``), its records
  (``Action``, ``StepResult``) and ``EpisodeError``;
* ``tools``: tools (name, JSON-schema arguments, callable, timeout), the one tool-call syntax
  and ``ToolBox``, which parses calls and runs them off the event loop under deadlines;
* ``chat``: ``ChatRenderer``, the token layout of a conversation (the tokenizer's chat
  template, or plain text);
* ``episode``: ``run_agent_episode``, the engine-agnostic loop model turn -> tool calls or
  environment step -> next turn, recording one token sequence with its loss mask;
* ``conformance``: the checks every environment (built-in or a user's) must pass.

This package is a leaf beside ``workloads``: it imports no component and no runtime, so an
environment written for it runs on any RaaS node, in a warm start or in a test alike.
"""
