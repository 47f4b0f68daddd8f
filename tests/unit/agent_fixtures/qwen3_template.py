"""Qwen3's chat template (the `chat_template` of Qwen/Qwen3-8B's tokenizer_config.json) without
its branch for an assistant message's `tool_calls` field (the agent loop keeps a turn's calls in
its text), for tests of templates that rewrite history: an earlier assistant turn loses its
`<think>` block once later messages follow (an empty one after any message, a non-empty one after
a new user query)."""

from typing import Any

QWEN3_TEMPLATE = (
"{%- if tools %}\n"
"    {{- '<|im_start|>system\\n' }}\n"
"    {%- if messages[0].role == 'system' %}\n"
"        {{- messages[0].content + '\\n\\n' }}\n"
"    {%- endif %}\n"
"    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
"    {%- for tool in tools %}\n"
"        {{- \"\\n\" }}\n"
"        {{- tool | tojson }}\n"
"    {%- endfor %}\n"
"    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
"{%- else %}\n"
"    {%- if messages[0].role == 'system' %}\n"
"        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
"    {%- endif %}\n"
"{%- endif %}\n"
"{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
"{%- for message in messages[::-1] %}\n"
"    {%- set index = (messages|length - 1) - loop.index0 %}\n"
"    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
"        {%- set ns.multi_step_tool = false %}\n"
"        {%- set ns.last_query_index = index %}\n"
"    {%- endif %}\n"
"{%- endfor %}\n"
"{%- for message in messages %}\n"
"    {%- if message.content is string %}\n"
"        {%- set content = message.content %}\n"
"    {%- else %}\n"
"        {%- set content = '' %}\n"
"    {%- endif %}\n"
"    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
"        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
"    {%- elif message.role == \"assistant\" %}\n"
"        {%- set reasoning_content = '' %}\n"
"        {%- if message.reasoning_content is string %}\n"
"            {%- set reasoning_content = message.reasoning_content %}\n"
"        {%- else %}\n"
"            {%- if '</think>' in content %}\n"
"                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
"                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
"            {%- endif %}\n"
"        {%- endif %}\n"
"        {%- if loop.index0 > ns.last_query_index %}\n"
"            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
"                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
"            {%- else %}\n"
"                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
"            {%- endif %}\n"
"        {%- else %}\n"
"            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
"        {%- endif %}\n"
"        {{- '<|im_end|>\\n' }}\n"
"    {%- elif message.role == \"tool\" %}\n"
"        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
"            {{- '<|im_start|>user' }}\n"
"        {%- endif %}\n"
"        {{- '\\n<tool_response>\\n' }}\n"
"        {{- content }}\n"
"        {{- '\\n</tool_response>' }}\n"
"        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
"            {{- '<|im_end|>\\n' }}\n"
"        {%- endif %}\n"
"    {%- endif %}\n"
"{%- endfor %}\n"
"{%- if add_generation_prompt %}\n"
"    {{- '<|im_start|>assistant\\n' }}\n"
"    {%- if enable_thinking is defined and enable_thinking is false %}\n"
"        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
"    {%- endif %}\n"
"{%- endif %}"
)


def qwen3_tokenizer() -> Any:
    """The tiny test tokenizer with Qwen3's template."""
    from services.common.tiny import build_tokenizer

    tok = build_tokenizer(tools=True)
    tok.chat_template = QWEN3_TEMPLATE
    return tok
