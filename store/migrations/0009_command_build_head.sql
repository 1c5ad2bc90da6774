-- The commit a command build builds (issue 17).
--
-- command_build.head_sha
--   the head commit's sha, written with the row by the trigger that starts the build (and
--   by the owner adopting a build found without a row). The trigger key is a Request's id
--   and a Request validates one commit, so a trigger that finds a build under its key
--   built for another commit has found a broken invariant (a hand-edited row, a reused
--   id), never a build to reuse: it fails instead of reporting that build's outcome.
--   NULL for builds started before this column: their key is trusted as before.

ALTER TABLE command_build ADD COLUMN head_sha text;
