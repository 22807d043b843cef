-- SPDX-License-Identifier: MIT
-- busted output handler: busted's plain terminal report, then skipped (pending) tests by name,
-- then one closing line "N passed, N failed, N skipped" (errors count as failed) that CI reads.
return function(options)
  local busted = require "busted"
  options.deferPrint = false
  local handler = require "busted.outputHandlers.plainTerminal"(options)

  local function closing()
    local h = handler
    io.write(string.format("%d passed, %d failed, %d skipped\n", h.successesCount,
      h.failuresCount + h.errorsCount, h.pendingsCount))
    io.flush()
    return nil, true
  end
  -- after the plain handler's own suite summary
  busted.subscribe({ "suite", "end" }, closing)
  return handler
end
