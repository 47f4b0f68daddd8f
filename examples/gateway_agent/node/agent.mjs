// A Node agent as meshrl's gateway starts it (agent.command = [node, examples/gateway_agent/node/agent.mjs]):
// the official `openai` npm package, a calculator tool it runs itself, nothing meshrl-specific.
// The prompt arrives as JSON on stdin; OPENAI_BASE_URL and OPENAI_API_KEY point the client at this
// sample's session. With --reward-self it reports its own reward to /finish; else it exits 0 and
// the reward service scores its last answer.
import OpenAI from "openai";

const TOOLS = [{
  type: "function",
  function: {
    name: "add",
    description: "Add two integers.",
    parameters: { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } }, required: ["a", "b"] },
  },
}];

function add(args) {
  try {
    const { a, b } = JSON.parse(args);
    return String(Number(a) + Number(b));
  } catch (e) {
    return `error: ${e.message}`;
  }
}

async function readStdin() {
  let text = "";
  for await (const chunk of process.stdin) text += chunk;
  return JSON.parse(text);
}

const prompt = await readStdin();
const client = new OpenAI({ maxRetries: 2 }); // reads OPENAI_BASE_URL and OPENAI_API_KEY
const messages = [...prompt.messages];
let answer = "";
for (let turn = 0; turn < 3; turn++) {
  const resp = await client.chat.completions.create({ model: "policy", messages, tools: TOOLS });
  const msg = resp.choices[0].message;
  messages.push(msg);
  answer = msg.content ?? "";
  if (!msg.tool_calls?.length) break;
  for (const call of msg.tool_calls) {
    messages.push({ role: "tool", tool_call_id: call.id, content: add(call.function.arguments) });
  }
}
if (process.argv.includes("--reward-self")) {
  const [a, b] = prompt.messages.at(-1).content.replace(/=$/, "").split("+").map(Number);
  const base = process.env.OPENAI_BASE_URL.replace(/\/v1$/, "");
  const r = await fetch(`${base}/finish`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${process.env.OPENAI_API_KEY}` },
    body: JSON.stringify({ reward: answer.trim() === String(a + b) ? 1.0 : 0.0 }),
  });
  if (!r.ok) throw new Error(`finish: ${r.status} ${await r.text()}`);
}
