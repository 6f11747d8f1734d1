"""What outlives a controller process: the policy's durable state (`state`, `view`,
`migration`), its typed JSON (`codec`), the journal written before each decision is acted upon
(`journal`), what a controller leaving on purpose hands its successor (`handover`), and the
job's run files (`records`). `standbys/` reads the journals of finished jobs from here."""
