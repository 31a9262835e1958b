"""kvguard's SGLang adapter: loaded by SGLang as a plugin (`sglang.srt.plugins` entry point,
`plugin.load`), it turns the scheduler's own KV calls into guard events (`adapter`), with the
page bookkeeping that attributes calls naming no request (`pages`). docs/engines.md says
how to attach it."""
