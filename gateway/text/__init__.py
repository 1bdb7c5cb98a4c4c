"""Text on its way to the engine: segmenting streamed text (segmenter), numbers and symbols as words (normalize),
per-key pronunciation rules (pronunciation) and the Unicode validity checks of client text (unicode_text)."""
