// Test input copied from microsoft/aici (MIT License): controllers/jsctrl/samples/hello.js @ ecc50362fe2c; program unchanged below.
async function main() {
    await $`Ultimate answer is to the life, universe and everything is `
    await gen({ regex: /\d\d/ })
}

start(main)
