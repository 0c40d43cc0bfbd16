"""Writing steps: ``writer`` (the run's single writer, the commit protocol), ``transaction``
(one step on its way to a commit), ``step_table`` (its arrays table, from columns),
``flat_encode`` (an encoded flat step laid out), ``job`` (a commit as data, run here or in the
flusher), ``parts`` (a rank's vote) and ``ranks`` (the multi-rank commit)."""
